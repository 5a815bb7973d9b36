"""Pure logic: models, quotas, virtual addressing, state machines. No I/O in here."""
