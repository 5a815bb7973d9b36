# The two commands a newcomer needs: `make demo` and `make test` (see README.md).
VENV ?= /opt/vrnic/venv
BIN := $(VENV)/bin
KERNEL_TIMEOUT ?= 2400

.PHONY: setup test test-host test-kernel test-two-hosts test-sriov-nic lint demo demo-vm demo-migrate demo-qos bench

setup:
	@./scripts/setup.sh

test: setup lint test-host test-kernel test-two-hosts test-sriov-nic

lint:
	$(BIN)/ruff check vrnic tests bench
	$(BIN)/mypy

# unit, api and libvirt tiers run on the host.
test-host:
	$(BIN)/pytest -m "unit or api or libvirt" tests

# The kernel tier runs inside the lab: a QEMU guest with Soft-RoCE and netdevsim.
test-kernel:
	$(BIN)/vrnic lab run --netdevsim --rerun-on-panic --timeout $(KERNEL_TIMEOUT) -- pytest -m kernel tests

# Two guests wired by a QEMU dgram link: an RDMA WRITE from guest b lands in guest a, verified by a.
test-two-hosts:
	$(BIN)/vrnic lab run --topology two-hosts --timeout 300 -- python -m vrnic.lab.smoke --two-hosts

# Real SR-IOV VFs (PCI functions with netdevs) on an emulated igb NIC; runs QEMU 10 (see make setup).
test-sriov-nic:
	$(BIN)/vrnic lab run --sriov-nic --topology single --rerun-on-panic --timeout 600 -- pytest -m kernel tests/kernel/test_sriov_vf_netdev.py tests/kernel/test_vm_sriov_hostdev.py

demo: setup
	$(BIN)/vrnic lab run -- python -m vrnic.demo

# A vRNIC in a real VM: nested KVM under libvirtd inside the lab, `vrnic vm attach`, the hook, RDMA both ways.
demo-vm: setup
	$(BIN)/vrnic lab run --timeout 900 -- python -m vrnic.lab.vm_demo

# Live migration of a VM in the middle of RDMA traffic between two raw QEMUs in the lab; vrnicd moves the vRNIC.
demo-migrate: setup
	$(BIN)/vrnic lab run --topology pair --timeout 900 -- python -m vrnic.lab.migrate_demo

# Two tenants share a link under their QoS caps: vrnicd's HTB on rxe0's uplink, a cap, a guarantee, a live change.
demo-qos: setup
	$(BIN)/vrnic lab run --topology pair --timeout 600 -- python -m vrnic.lab.qos_demo

bench: setup
	$(BIN)/python -m bench.run
