"""The calserve exception tree. HTTP status codes exist only in ``calserve/api``; this module only names
what went wrong.

    CalserveError
    ├── ConfigError                 config file/section invalid (start-up fails; message names the key)
    ├── PackageError                a model package was refused (message names the file and reason)
    │   ├── PackagePathError        outside the trusted model root, symlink/.. escape, missing
    │   ├── SignatureError          unsigned, untrusted key, bad signature
    │   ├── IntegrityError          hash mismatch, missing or extra file
    │   └── ValidationError         schema, tensor names/shapes/dtypes, profiles, compatibility
    ├── RequestError                a request can never be served as asked            (api: 400)
    │   └── UnsupportedParameter    a parameter that would change results is not supported (400)
    ├── AuthError                   unknown API key                                   (api: 401)
    ├── UnknownModel                no such alias                                     (api: 404)
    ├── CapacityError               queue/token budget/tenant quota full right now    (api: 429)
    ├── UnavailableError            model loading/draining/recovering/failed          (api: 503)
    ├── DeviceError                 the device failed a job the request depended on   (api: 500/stream error)
    └── EngineError                 the engine is not running or crashed               (api: 503)

``RequestError`` and friends carry ``param`` (the field, OpenAI style ``messages[0].content``) and,
for 429/503, ``retry_after`` seconds.
"""

from __future__ import annotations

__all__ = [
    "CalserveError",
    "ConfigError",
    "PackageError",
    "PackagePathError",
    "SignatureError",
    "IntegrityError",
    "ValidationError",
    "RequestError",
    "UnsupportedParameter",
    "AuthError",
    "UnknownModel",
    "CapacityError",
    "UnavailableError",
    "DeviceError",
    "EngineError",
]


class CalserveError(Exception):
    """Base of every error calserve raises on purpose."""

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after


class ConfigError(CalserveError):
    pass


class PackageError(CalserveError):
    pass


class PackagePathError(PackageError):
    pass


class SignatureError(PackageError):
    pass


class IntegrityError(PackageError):
    pass


class ValidationError(PackageError):
    pass


class RequestError(CalserveError):
    pass


class UnsupportedParameter(RequestError):
    pass


class AuthError(CalserveError):
    pass


class UnknownModel(CalserveError):
    pass


class CapacityError(CalserveError):
    pass


class UnavailableError(CalserveError):
    pass


class DeviceError(CalserveError):
    pass


class EngineError(CalserveError):
    pass
