"""SR-IOV alternate mode: a whole VF per vRNIC, hardware-isolated.

Pure parts (no I/O, unit tested): vf_types, pool, plan, reconcile, count, libvirt_xml, store (in-memory).
Host edges (thin, errno -> vrnic.errors): sysfs, netlink, netns.
Orchestration over injected edges: manager.SriovManager, which the `sriov` RnicDriver and, later,
the REST API call.
"""
