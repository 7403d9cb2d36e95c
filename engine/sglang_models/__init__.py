"""The model classes an engine registers at start (SGLang's ``SGLANG_EXTERNAL_MODEL_PACKAGE``).

SGLang 0.5.23 imports every module of ``sglang.srt.models`` (~285 classes) when its model
registry is first imported, in every scheduler process: 7-8 s of an engine's start on our
CPU. With this package named there, a scheduler imports only ``registered``'s classes, the
architectures colocate builds and checks (``engine/start_checks.py``), and resolves any other
architecture by loading SGLang's full registry as before (``ModelRegistry.resolve_model_cls``),
so every model still starts; only the common ones start sooner.
"""
