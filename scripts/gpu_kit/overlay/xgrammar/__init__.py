"""Import-only stand-in for xgrammar (the GPU image has none; the real one needs the real
apache-tvm-ffi, which the kit stubs). SGLang 0.5.23's detokenizer process imports every
tool-call detector at start (parser/response_template.py:1038 -> function_call_parser),
and several import ``StructuralTag`` (and ``structural_tag``'s formats) at module load.
Grammar-constrained decoding is off with ``skip_tokenizer_init`` (constrained/
grammar_manager.py:36), so nothing here is ever called; ``get_model_structural_tag`` is
left out on purpose, so base_format_detector.py:10 takes its ImportError fallback.
``StructuralTag`` is a pydantic model there too: entrypoints/openai/protocol.py uses it as
a field type."""

from pydantic import BaseModel, ConfigDict


class StructuralTag(BaseModel):
    model_config = ConfigDict(extra="allow")


class Grammar:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("xgrammar is not in the GPU kit")
