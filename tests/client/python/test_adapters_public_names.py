"""test_public_names.py's rules for the adapters subpackage, whose modules
pkgutil does not list at the package's top level: a docstring on every
module and public name, type hints on every public function."""

import importlib
import inspect
import pkgutil

import kvcached.adapters
from test_public_names import public_members

MODULES = [importlib.import_module("kvcached.adapters." + info.name)
           for info in pkgutil.iter_modules(kvcached.adapters.__path__)
           if not info.name.startswith("_")]


def public_functions():
    for module in MODULES:
        for name, member in public_members(module):
            if inspect.isfunction(member):
                yield "%s.%s" % (module.__name__, name), member
            elif inspect.isclass(member):
                for method_name, method in vars(member).items():
                    if isinstance(method, property):
                        method = method.fget
                    if inspect.isfunction(method) and not method_name.startswith("_"):
                        yield "%s.%s.%s" % (module.__name__, name, method_name), method


def test_every_adapter_module_and_public_name_has_a_docstring():
    assert len(MODULES) >= 6
    missing = [module.__name__ for module in MODULES if not module.__doc__]
    for module in MODULES:
        missing += ["%s.%s" % (module.__name__, name) for name, member in public_members(module)
                    if not inspect.getdoc(member)]
    missing += [name for name, function in public_functions() if not inspect.getdoc(function)]
    assert missing == []


def test_every_adapter_function_has_type_hints():
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
