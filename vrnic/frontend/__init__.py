"""vrnic.frontend."""
