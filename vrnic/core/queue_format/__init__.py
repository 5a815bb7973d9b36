"""Queue formats of the direct data path: how a device's own queues look to the guest that drives them."""
