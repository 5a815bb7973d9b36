"""VM attachment of a vRNIC: libvirt/QEMU domains whose RAM file is the guest memory vrnicd maps.

domain_xml.py (pure): typed domain description -> libvirt domain XML.
guest_ram.py: guest-physical addresses as offsets in the VM's RAM file, and a MAP_SHARED view of it.
hook.py (pure): the libvirt qemu hook's (argv, stdin XML) -> a typed event.
"""
