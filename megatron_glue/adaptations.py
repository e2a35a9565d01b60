"""`megatron_glue.adaptations`, the path the README documents for its users: the module
`megatron_glue.capture.adaptations` itself (the same module object, so the same names and state), not a copy."""

import sys

from megatron_glue.capture import adaptations

sys.modules[__name__] = adaptations
