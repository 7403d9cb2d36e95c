"""Import-only IPython for the GPU kit (SGLang imports it; none runs). matplotlib, finding
IPython imported, reads its version (from 8.24 on it leaves IPython's GUI hooks alone) and,
in pyplot, asks get_ipython() for a shell (None: not running in IPython)."""

version_info = (8, 24, 0)


def get_ipython():
    return None
