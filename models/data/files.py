"""Where the named data sets' files are: ``data.dir``, else ``$FEDSURV_DATA_DIR``, else the bundled copy.

The package ships METABRIC, GBSG and WHAS (DeepSurv's CSVs) and the SBA loan subset (gzip) in
``models/data/bundled/`` (its README gives each file's rows, columns, source and licence), so every
named data set loads in a fresh install. A folder named by ``data.dir`` or ``$FEDSURV_DATA_DIR``
replaces the bundled one; it holds the same file names, each plain or gzip-compressed (``.gz``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from models.data.validate import DataValidationError

#: Environment variable naming a data folder when ``data.dir`` is empty.
DATA_DIR_ENV = "FEDSURV_DATA_DIR"
#: File of each named data set read from the data folder (plain or with ``.gz`` appended).
DATA_FILES = {
    "metabric": "metabric.csv",
    "gbsg": "gbsg.csv",
    "whas": "whas.csv",
    "sba": "sba_national_subset.csv",
}


def _bundled_dir() -> Path:
    """``models/data/bundled`` beside this module, or, where that copy has no data, the installed package's.

    ``flwr run`` loads the apps from the Flower app bundle it built (FAB), which carries Python
    and text files only, never the CSVs: the installed package (an editable install's source
    tree, or site-packages) is then found on ``sys.path`` after the bundle.
    """
    here = Path(__file__).resolve().parent / "bundled"
    for folder in (here, *(Path(entry or ".") / "models" / "data" / "bundled" for entry in sys.path)):
        if any((folder / name).exists() or (folder / f"{name}.gz").exists() for name in DATA_FILES.values()):
            return folder.resolve()
    return here


#: The folder of the files shipped with the package.
BUNDLED_DIR = _bundled_dir()


def resolve_data_dir(data_dir: str | Path = "") -> Path:
    """The data folder: ``data_dir`` if given, else ``$FEDSURV_DATA_DIR`` if set, else :data:`BUNDLED_DIR`.

    Parameters
    ----------
    data_dir
        The run's ``data.dir`` ("" = not set). A relative path is taken from the working directory.

    Returns
    -------
    Path
        The folder as an absolute path (whether or not it exists; :func:`data_file` checks).
    """
    return Path(data_dir or os.environ.get(DATA_DIR_ENV, "") or BUNDLED_DIR).resolve()


def data_file(name: str, data_dir: str | Path = "") -> Path:
    """The file of the named data set in the folder :func:`resolve_data_dir` gives.

    Parameters
    ----------
    name
        A key of :data:`DATA_FILES` (``metabric``, ``gbsg``, ``whas``, ``sba``).
    data_dir
        The run's ``data.dir`` ("" = ``$FEDSURV_DATA_DIR`` or the bundled folder).

    Returns
    -------
    Path
        ``<folder>/<file>`` if it exists, else ``<folder>/<file>.gz`` (pandas reads either).

    Raises
    ------
    DataValidationError
        For an unknown name, or when the folder holds neither file (the message names the file
        and where the folder came from).
    """
    if name not in DATA_FILES:
        raise DataValidationError(f"no bundled file for data set '{name}'; options: {', '.join(DATA_FILES)}")
    folder = resolve_data_dir(data_dir)
    for candidate in (folder / DATA_FILES[name], folder / f"{DATA_FILES[name]}.gz"):
        if candidate.is_file():
            return candidate
    origin = ("set by data.dir" if data_dir else f"set by ${DATA_DIR_ENV}" if os.environ.get(DATA_DIR_ENV)
              else "bundled with the package")
    raise DataValidationError(f"{folder / DATA_FILES[name]}: file not found, nor its .gz (folder {origin})")
