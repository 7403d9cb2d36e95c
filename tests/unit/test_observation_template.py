"""Issue 39.8: a chat template that refuses the observation's role (strict alternation, as
Gemma's) gives one line naming ``Observation.role`` and the roles it accepts, under the
environment's error policy, not jinja's raw error mid-step."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from colocate.assets.random_models import build_tiny_tokenizer
from colocate.rollout.sample import Sample
from colocate.rollout.scripted_env import ScriptedEnv
from colocate.rollout.turns import EnvError, EnvErrors, EnvTurns, ObservationTemplate, TemplateRoleError

STRICT = (  # user/assistant strictly alternating, as Gemma's template checks
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("strict")))
    tok.chat_template = STRICT
    return tok


def test_a_refused_role_is_one_line_naming_the_field_and_the_roles_it_accepts(strict):
    template = ObservationTemplate(strict, [2])
    with pytest.raises(TemplateRoleError) as e:
        template.ids("4", "tool", [5, 2])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("Observation.role 'tool'") and "accepts: user" in msg
    assert isinstance(e.value, EnvError)
    assert template.ids("4", "user", [5, 2])  # the role it accepts renders
    with pytest.raises(TemplateRoleError, match="Observation.role 'tool'"):
        ObservationTemplate(strict, [2]).check("tool")  # what the build runs at start for env.role


def _answer(strict, on_error):
    errors = EnvErrors()
    turns = EnvTurns(ScriptedEnv(role="tool"), ObservationTemplate(strict, [2]), lambda ids: "x",
                     max_turns=3, on_error=on_error, errors=errors)
    sample = Sample(3, [1, 5, 6], 8)
    sample.output_ids, sample.logprobs, sample.versions = [7, 8], [0.0, 0.0], [0, 0]
    return asyncio.run(turns.answer(sample)), errors


def test_the_refusal_follows_the_environments_error_policy(strict):
    with pytest.raises(EnvError) as e:
        _answer(strict, "raise")
    assert "\n" not in str(e.value) and "rollout.env scripted: turn" in str(e.value)
    assert "Observation.role 'tool'" in str(e.value)
    reply, errors = _answer(strict, "zero")  # ended there, counted, nothing added
    assert reply.done and reply.ids == [] and errors.count == 1 and "Observation.role" in errors.last
