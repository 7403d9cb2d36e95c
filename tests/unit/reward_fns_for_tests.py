"""Reward functions named by tests as ``reward.fns=tests.unit.reward_fns_for_tests:<name>``
(not a test module: pytest collects nothing here)."""

from __future__ import annotations

CONSTANT = 0.25


def constant(record, text):
    """Every response scores :data:`CONSTANT` (a run's reward_mean shows it was called)."""
    return CONSTANT


async def async_length(record, text):
    return float(len(text))


def turns(record, text, messages):
    return float(len(messages))


class Scorer:
    def __call__(self, record, text, **kwargs):
        return 1.0


SCORER = Scorer()
NOT_A_FUNCTION = 3


def one_argument(record):
    return 0.0


def three_arguments(record, text, extra):
    return 0.0


def keyword_only(*, record, text):
    return 0.0


class Namespace:
    inner = staticmethod(constant)


def says_seven(record, text):
    """1.0 when the last number the model wrote is the record's answer (a gsm8k '#### 7'):
    the learning signal of ``tests/integration/test_dataset_run.py`` through reward.fns."""
    import re

    numbers = re.findall(r"\d+", text)
    return float(bool(numbers) and numbers[-1] == record["answer"].split("####")[-1].strip())
