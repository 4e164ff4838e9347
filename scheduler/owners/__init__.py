"""The row owners: the only modules that write Schedule, Execution, Lease and Instance rows."""
