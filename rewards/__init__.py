"""The built-in reward functions (docs/rewards.md), registered by name, each imported at its first use.

    digits_match, digits_step_match   the demo's task (rewards/digits.py)
    math_correct                      a math answer against the gold one (rewards/math_answer.py, math-verify)
    format_strict, format_soft        the reasoning / answer tags (rewards/format.py)
    countdown                         the Countdown puzzle's equation (rewards/countdown.py)
    code_tests                        a program against its unit tests, in the sandbox (rewards/code_tests.py)

A function of your own is named in the config as ``package.module:function`` (or passed to ``grpo.train``). How
the run's sources are called, in worker processes, and combined: grpo/scoring/combined.py.
"""

from __future__ import annotations

from grpo.foundation.plugins import REWARDS, STEP_REWARDS

# the built-in reward functions by name, as ``module:function`` (imported at first use), the way every plug-in package
# registers its built-ins (grpo/foundation/registry.py)
BUILT_IN = {"digits_match": "rewards.digits:digits_match", "math_correct": "rewards.math_answer:math_correct",
            "format_strict": "rewards.format:format_strict", "format_soft": "rewards.format:format_soft",
            "countdown": "rewards.countdown:countdown", "code_tests": "rewards.code_tests:code_tests"}
for _name, _target in BUILT_IN.items():
    REWARDS.register(_name, _target)
STEP_REWARDS.register("digits_step_match", "rewards.digits:digits_step_match")  # grpo-ps's step rewards
