"""The lab: run a command inside a throw-away QEMU guest with Soft-RoCE ready.

Pure parts (QEMU argv, guest scripts) live in qemu.py and guest.py; the side
effects (kernel lookup, initramfs, spawning QEMU) in kernel.py, initramfs.py
and runner.py.
"""
