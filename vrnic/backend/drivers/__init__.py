"""RNIC drivers, registered under the `vrnic.drivers` entry point group."""
