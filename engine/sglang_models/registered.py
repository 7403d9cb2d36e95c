"""The model classes a scheduler registers at start (see the package doc)."""

from ..sglang_api import model_classes

EntryClass = model_classes()  # SGLang's registry reads this name
