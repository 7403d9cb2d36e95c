"""The format classes kimik3_structural_tag.py imports at module load; none is ever built."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"xgrammar.structural_tag.{name} is not in the GPU kit")
    return type(name, (), {"__init__": unavailable})
