"""Model packages (calculet-calbin/v1): format, signing, verification, validation, capacity plan.

Public entry points (import from the submodules):

- :func:`calserve.models.package.open_package` -> :class:`VerifiedPackage` (spec §11 steps 1–3)
- :mod:`calserve.models.validate`: ``runnable_profiles``, ``check_scheduler_config``,
  ``compare_introspection``
- :func:`calserve.models.capacity.plan_capacity` -> ``CapacityPlan``
- :class:`calserve.models.tokenizer.Tokenizer`
- :func:`calserve.models.demo.ensure_demo_package`
- :mod:`calserve.models.timing`: named ``Timing`` profiles
- :mod:`calserve.models.signing`: keys, ``sign_package``, ``TrustStore``
"""
