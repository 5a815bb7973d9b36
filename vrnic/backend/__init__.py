"""vrnic.backend."""
