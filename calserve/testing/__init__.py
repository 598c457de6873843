"""Test doubles shipped with the package: a trio-native fake device backend (``fake_device``) for
fake-clock engine tests and benchmarks of the host path."""
