"""vrnic: a control plane that virtualizes RDMA NICs for VMs and containers."""

__version__ = "0.1.0"
