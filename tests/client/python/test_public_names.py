"""Every public name of the package says what it is: a docstring, and type
hints on every public function's parameters and result."""

import importlib
import inspect
import pkgutil

import kvcached


def _public_modules():
    """kvcached's modules and its subpackages' (kvcached.models needs torch,
    which the package does not: without torch those are left out)."""
    names = [info.name for info in pkgutil.walk_packages(kvcached.__path__, "kvcached.",
                                                         onerror=lambda name: None)
             if not any(part.startswith("_") for part in info.name.split("."))]
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ModuleNotFoundError as missing:
            if missing.name != "torch":
                raise
    return modules


MODULES = _public_modules()


def public_members(module):
    for name, member in vars(module).items():
        if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(member) or inspect.isfunction(member):
            yield name, member


def public_functions():
    for module in MODULES:
        for name, member in public_members(module):
            if inspect.isfunction(member):
                yield "%s.%s" % (module.__name__, name), member
            elif inspect.isclass(member):
                for method_name, method in vars(member).items():
                    if inspect.isfunction(method) and not method_name.startswith("_"):
                        yield "%s.%s.%s" % (module.__name__, name, method_name), method


def test_every_module_and_public_name_has_a_docstring():
    missing = [module.__name__ for module in MODULES if not module.__doc__]
    for module in MODULES:
        missing += ["%s.%s" % (module.__name__, name) for name, member in public_members(module)
                    if not inspect.getdoc(member)]
    missing += [name for name, function in public_functions() if not inspect.getdoc(function)]
    assert missing == []


def test_every_public_function_has_type_hints():
    unhinted = []
    for name, function in public_functions():
        signature = inspect.signature(function)
        for parameter in signature.parameters.values():
            if parameter.name in ("self", "cls") or parameter.kind in (
                    parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            if parameter.annotation is parameter.empty:
                unhinted.append("%s(%s)" % (name, parameter.name))
        if signature.return_annotation is signature.empty:
            unhinted.append("%s -> ?" % name)
    assert unhinted == []
