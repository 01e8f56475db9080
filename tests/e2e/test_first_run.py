"""The README's first request, as a new user sends it (issue 16): no temperature, no max_tokens.

The embedded SmolLM2 answers it through its generation_config.json defaults (greedy). Measured on a bare vLLM
server with the converted folder and no sampling parameters: "Paris" in 30/30 answers; the bound below (9/10)
is the issue's, and leaves room for a batch-dependent flip of the first token ("The" p=0.155 vs "L" p=0.14).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.e2e

README_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TRIES, NEED = 10, 9


def test_readme_question_is_answered_right_at_default_sampling(fleet):
    client = fleet.client(timeout=300)

    def ask(_):
        return client.chat.completions.create(model="smollm2", messages=README_QUESTION).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(TRIES)))
    right = sum("Paris" in a for a in answers)
    assert right >= NEED, f"Paris in {right}/{TRIES} answers: {answers}"
