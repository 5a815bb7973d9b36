"""vrnic.api."""
