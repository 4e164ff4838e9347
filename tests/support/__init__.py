"""Test tooling: services, processes, factories, invariants and the tasks the tests run."""
