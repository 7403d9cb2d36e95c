"""The GPU image's missing packages, simulated on a CPU machine (a dry run of the kit).

Put this folder first on PYTHONPATH, with the kit's overlay after it and colocate's CPU
stand-in (engine/cpu_kernel) before the overlay, then run the check's CPU dry run:

    PYTHONPATH=scripts/gpu_kit/image_sim:engine/cpu_kernel:scripts/gpu_kit/overlay \\
        DEVICE=cpu OUT=/tmp/sim bash scripts/gpu_engine_check.sh

Every Python process (SGLang's scheduler and detokenizer children too: they inherit
PYTHONPATH, and ``site`` imports this module at start) then finds none of the packages
below that this machine has and the GPU image (Python 3.12, torch 2.11, the project's
`.gpukit/site.tgz`) lacks, unless a folder on PYTHONPATH outside site-packages provides
one (the overlay's stand-ins). The list was read off SGLang's engine, scheduler,
detokenizer and Llama model imports on CPU, minus the image's package list
(/work/.library/device/KINDS.md) and the kit's wheels. A missing name makes an import
fail as it would there (``import x`` -> ModuleNotFoundError; ``find_spec`` -> None).
"""

import os
import sys

MISSING = (
    "xgrammar tvm_ffi IPython mistral_common pycountry pydantic_extra_types jsonschema referencing rpds "
    "jsonschema_specifications rfc3339_validator jsonpointer boto3 botocore jmespath s3transfer python_multipart "
    "multipart soundfile trio outcome watchfiles zstandard asttokens jedi parso pexpect pickleshare prompt_toolkit "
    "ptyprocess pure_eval stack_data traitlets wcwidth backcall decorator executing openai_harmony llguidance "
    "outlines interegular blobfile datasets easydict numba timm anthropic modelscope xxhash"
).split()


def _provided_outside_site_packages(name: str) -> bool:
    for entry in sys.path:
        if not entry or "site-packages" in entry:
            continue
        if os.path.isdir(os.path.join(entry, name)) or os.path.isfile(os.path.join(entry, name + ".py")):
            return True
    return False


for _name in MISSING:
    if not _provided_outside_site_packages(_name):
        sys.modules.setdefault(_name, None)
