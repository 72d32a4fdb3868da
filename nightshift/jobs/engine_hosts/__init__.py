"""Engine hosts: the engine workers that are alive, the models each serves and whether it could
load them (a table the workers keep fresh with a heartbeat; validation and the reconciler read it)."""
