"""Deprecated: the API's pydantic types are :mod:`jupyter_evalsched.schemas` (in this project a
"model" is an ML model, see :mod:`jupyter_evalsched.shared_models`). Importing this module gives
that module itself, with a DeprecationWarning, so that code written against the old name keeps
working."""

import sys
import warnings

from . import schemas

warnings.warn(
    "jupyter_evalsched.models is deprecated: import jupyter_evalsched.schemas instead", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = schemas
