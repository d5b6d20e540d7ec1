"""Packages are found, not listed: ``ckptd/`` and its subpackages, plus ``client/``
and ``server/``, which install as ``ckptd.client`` and ``ckptd.server``. A
subpackage added under any of them ships without an edit here (a list by hand
once left out ``ckptd.server.routes``). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

# Import name -> source folder.
ROOTS = {"ckptd": "ckptd", "ckptd.client": "client", "ckptd.server": "server"}


def packages() -> list[str]:
    """Every package under each root, by its import name."""
    found: list[str] = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(package_dir=ROOTS, packages=packages())
