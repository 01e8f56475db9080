"""What ``lmfleet bench`` sends: the public names of its workload modules, in one place.

:mod:`lmfleet.bench.mix` holds mixes (classes, token distributions, shared prefixes) and their parsing;
:mod:`lmfleet.bench.prompts` turns a mix, a dataset or a timed trace into requests with synthesised prompts;
:mod:`lmfleet.bench.trace`, :mod:`lmfleet.bench.shapes` and :mod:`lmfleet.bench.replay` build timed traces
(synthetic shapes, replays of recorded traffic).
"""

from lmfleet.bench.mix import (API_KINDS, INLINE_OPTIONS, BenchInputError, BenchRequest, PrefixPool, TokenDist,
                               WorkloadClass, WorkloadMix, check_context, fixed_completion_mix, load_mix,
                               mix_from_dict, parse_mix_inline, parse_prefix_pool, parse_token_dist, validate_mix,
                               with_weights)
from lmfleet.bench.prompts import (PromptSynthesizer, SessionBook, Tokenizer, load_dataset, pick_class,
                                   sample_requests, trace_requests)

__all__ = ["API_KINDS", "INLINE_OPTIONS", "BenchInputError", "BenchRequest", "PrefixPool", "PromptSynthesizer",
           "SessionBook", "TokenDist", "Tokenizer", "WorkloadClass", "WorkloadMix", "check_context",
           "fixed_completion_mix", "load_dataset", "load_mix", "mix_from_dict", "parse_mix_inline",
           "parse_prefix_pool", "parse_token_dist", "pick_class", "sample_requests", "trace_requests",
           "validate_mix", "with_weights"]
