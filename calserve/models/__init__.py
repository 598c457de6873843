"""Model packages (calculet-calbin/v1): format, signing, verification, validation, capacity plan."""
