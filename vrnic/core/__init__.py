"""Pure logic: specs, quotas, session state, virtual addressing, rings, the guest protocol, state machines. No I/O."""
