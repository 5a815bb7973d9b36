"""vrnic.core."""
