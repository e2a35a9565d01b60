"""`megatron_glue.distributed`, the path the README documents for its users: the module
`megatron_glue.capture.distributed` itself (the same module object, so the same names and state), not a copy."""

import sys

from megatron_glue.capture import distributed

sys.modules[__name__] = distributed
