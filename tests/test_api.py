"""The public surface: exported names, the error hierarchy, imports."""

import pickle
import subprocess
import sys
import weakref

import numpy as np
import pytest

import sharedmem as sm
from conftest import gc_collect_harder

EXPORTED = {
    "AccessConflictError", "AliasError", "Allocation", "Atomic", "BackendUnavailableError",
    "CaptureError", "Graph", "capture", "graph",
    "Buffer", "CompletionUnknownError", "CudaError", "Device", "DeviceBox", "DeviceFuture",
    "DeviceMismatchError", "DeviceOp", "Event", "HostFuture", "HostKernel", "HostKernelError", "In", "InOut", "KernelAdapter",
    "KernelError", "LayoutError", "LeakWarning", "MovedError", "Out", "PeerAccessError", "ReadOnlyError", "ReleasedError",
    "SharedMemError", "SharedMemWarning", "Stats", "Stream", "Tensor", "default_device",
    "adopt", "from_cuda_array_interface", "from_dlpack", "record_use", "get_access_policy", "host_kernel", "launch",
    "InFlight", "inflight", "trace",
    "lookup_allocation", "op", "register_kernel_adapter", "set_access_policy", "show_config",
    "stats", "synchronize", "__version__",
}


def test_exported_names():
    assert set(sm.__all__) == EXPORTED
    for name in sm.__all__:
        obj = getattr(sm, name)
        if callable(obj) and not name.startswith("__"):
            assert obj.__doc__, f"{name} has no docstring"


def test_error_hierarchy_and_pickling():
    for name in ["AccessConflictError", "AliasError", "BackendUnavailableError", "CudaError",
                 "CaptureError",
                 "CompletionUnknownError", "DeviceMismatchError", "KernelError", "LayoutError",
                 "MovedError", "PeerAccessError", "ReadOnlyError", "ReleasedError", "HostKernelError"]:
        cls = getattr(sm, name)
        assert issubclass(cls, sm.SharedMemError)
        assert cls.__module__ == "sharedmem.errors"
        e = cls("what was wrong") if cls is not sm.AliasError else cls("msg", ("a view",))
        e2 = pickle.loads(pickle.dumps(e))
        assert type(e2) is cls and str(e2) == str(e)
    assert pickle.loads(pickle.dumps(sm.AliasError("m", ("v1", "v2")))).views == ("v1", "v2")
    assert issubclass(sm.LeakWarning, sm.SharedMemWarning)


def test_import_pulls_in_no_gpu_library():
    code = ("import sys, sharedmem, interop, interop.cupy, interop.cutile, interop.dlpack, interop.cai; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cupy', 'torch', 'jax') "
            "or m.startswith('cuda.')]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_direct_construction_points_to_the_factory():
    with pytest.raises(TypeError, match=r"^Buffer cannot be constructed directly; use Buffer.empty"):
        sm.Buffer(3)
    with pytest.raises(TypeError, match=r"^Tensor cannot be constructed directly"):
        sm.Tensor()
    with pytest.raises(TypeError, match=r"^Stream cannot be constructed directly"):
        sm.Stream()


def test_backend_selection(monkeypatch):
    import sharedmem.device as d
    monkeypatch.setattr(d, "_default", None)
    monkeypatch.setenv("SHAREDMEM_BACKEND", "host")
    assert sm.default_device() is sm.Device.host()
    monkeypatch.setattr(d, "_default", None)
    monkeypatch.setenv("SHAREDMEM_BACKEND", "tpu")
    with pytest.raises(sm.BackendUnavailableError, match=r"^SHAREDMEM_BACKEND='tpu' is not a backend"):
        sm.default_device()
    monkeypatch.setattr(d, "_default", None)
    with pytest.raises(ValueError, match="Device.host"):
        sm.Device(-1)


def test_moved_and_released_handles_keep_nothing_alive(host):
    b = sm.Buffer.from_host(np.arange(4), device=host)
    ref = weakref.ref(b.allocation)
    t = sm.Tensor.from_buffer(b, (4,))
    b2 = t.into_buffer()
    b2.release()
    gc_collect_harder()
    assert ref() is None  # b and t (moved) and b2 (released) hold no reference
    assert not b.is_live and not t.is_live


def test_dtype_and_length_errors(host):
    with pytest.raises(TypeError, match="cannot live in device memory"):
        sm.Buffer.empty(3, object, device=host)
    with pytest.raises(sm.LayoutError, match=r"^a buffer length must be an int >= 0, got -1$"):
        sm.Buffer.empty(-1, device=host)
    for bad in (2.0, True, "3", None):
        with pytest.raises(TypeError, match=r"^a buffer length must be an int >= 0, got "):
            sm.Buffer.empty(bad, device=host)
    # errors.md: a length (a Buffer's one dimension) of 2**63 or more is a LayoutError, as a
    # tensor's is -- it was a MemoryError (its byte count beyond memory), unlike
    # Tensor.empty((2**63,))
    for n in (2**63, np.uint64(2**63), 2**70):
        with pytest.raises(sm.LayoutError, match=r"^a buffer length must be below 2\*\*63, got "):
            sm.Buffer.empty(n, "int8", device=host)
    with pytest.raises(sm.LayoutError):
        sm.Tensor.empty((2**63,), "int8", device=host)
    with pytest.raises(MemoryError):  # (below 2**63 elements, beyond memory: as documented)
        sm.Buffer.empty(2**62, device=host)
    t = sm.Tensor.empty((2, 2), device=host)
    assert t.is_contiguous() is True and t[::2].is_contiguous() is True
    b2 = sm.Buffer.zeros(8, device=host)
    assert sm.Tensor.from_buffer(b2, (2, 2), strides=(4, 1)).is_contiguous() is False
    with pytest.raises(sm.LayoutError, match="copy_from needs 3 elements, got an array of 2"):
        sm.Buffer.empty(3, device=host).copy_from(np.zeros(2))
    b = sm.Buffer.zeros(8, device=host)
    with pytest.raises(sm.LayoutError, match=r"^copy_from between overlapping bytes of allocation #\d+ \(\[0, 16\) into \[8, 24\)\) is undefined"):
        b[2:6].copy_from(b[0:4])
    b[4:8].copy_from(b[0:4]).result(5)  # disjoint ranges of one allocation are fine


def test_both_backends_implement_the_written_protocols():
    from sharedmem.backends import Backend, Marker, StreamImpl
    from sharedmem.backends.cuda import CudaBackend, CudaMarker, CudaStreamImpl
    from sharedmem.backends.host import HostBackend, HostMarker, HostStreamImpl

    import os
    root = os.path.dirname(os.path.abspath(sm.__file__))
    src = {m: open(os.path.join(root, "backends", m.rsplit(".", 1)[1] + ".py")).read()
           for m in ("sharedmem.backends.cuda", "sharedmem.backends.host")}

    def members(proto):
        names = {n for n in vars(proto) if not n.startswith("_")}
        return names | set(getattr(proto, "__annotations__", {}))

    for proto, impls in [(Backend, (HostBackend, CudaBackend)),
                         (StreamImpl, (HostStreamImpl, CudaStreamImpl)),
                         (Marker, (HostMarker, CudaMarker))]:
        for cls in impls:
            have = set(dir(cls)) | set(getattr(cls, "__slots__", ()))
            init = src[cls.__module__]  # (compiled modules have no inspectable source)
            missing = {n for n in members(proto) if n not in have and f"self.{n} =" not in init}
            assert not missing, f"{cls.__name__} lacks {sorted(missing)} of {proto.__name__}"
    h = sm.Device.host()
    assert isinstance(h.backend, Backend) and isinstance(h.default_stream._impl, StreamImpl)
    assert isinstance(h.backend.record_marker(h.default_stream._impl), Marker)


def test_an_uncompiled_install_says_so_at_import_and_why_the_host_was_chosen(tmp_path):
    # a copy of the sources with no compiled module: what a machine without a C compiler has
    # (the sources imported: a checkout's, or an installed wheel's, as cibuildwheel tests it)
    import os
    import shutil
    root = os.path.dirname(os.path.dirname(os.path.abspath(sm.__file__)))
    for pkg in ("sharedmem", "interop"):
        shutil.copytree(os.path.join(root, pkg), tmp_path / pkg,
                        ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__"))
    code = ("import warnings, sharedmem as sm; import sharedmem.device as d; "
            "print(sm.show_config(open('/dev/null', 'w'))['core'])")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHAREDMEM_PURE_PYTHON", "SHAREDMEM_REQUIRE_EXTENSION")}
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "interpreted (the compiled modules were not built)"
    assert "SharedMemWarning: sharedmem: the compiled core is not built here, so it runs " \
           "interpreted" in r.stderr
    env["SHAREDMEM_PURE_PYTHON"] = "1"  # asked for: nothing to say
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "SharedMemWarning" not in r.stderr, r.stderr


def test_the_build_switch_holds_when_interop_is_imported_first():
    """SHAREDMEM_PURE_PYTHON=1 runs interop's compiled modules from source as well, also when
    a program imports one of them before sharedmem (else a compiled interop module would run
    beside an interpreted core)."""
    import importlib.machinery
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # (this interpreter's: not another's)
    if not os.path.exists(os.path.join(root, "interop", "dlpack" + suffix)):
        pytest.skip("needs the compiled modules (make build)")
    code = ("import interop.dlpack, sharedmem.allocation as a; "
            "print(interop.dlpack.__file__.endswith('.py'), a.__file__.endswith('.py'))")
    env = dict(os.environ, PYTHONPATH=root)
    for flag, want in (("1", "True True"), ("0", "False False")):
        env["SHAREDMEM_PURE_PYTHON"] = flag
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, cwd=root, timeout=120)
        assert (r.returncode, r.stdout.strip()) == (0, want), r.stderr


def test_import_sharedmem_imports_no_interop(tmp_path):
    """``import sharedmem`` asks where interop's compiled modules would load from without
    importing the ``interop`` package (DESIGN.md: sharedmem never imports interop at module
    level): it did, running a user's own ``interop.py`` in the working directory -- and then
    found no compiled interop there, warned that the core was not built, and with
    SHAREDMEM_REQUIRE_EXTENSION=1 refused to import."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "interop.py").write_text("print('the user interop ran')\n")
    code = "import sys, sharedmem; print('interop' in sys.modules)"
    for flag in ("0", "1"):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(["", root]),
                   SHAREDMEM_PURE_PYTHON=flag)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=120)
        assert (r.returncode, r.stdout) == (0, "False\n"), (r.stdout, r.stderr)


def test_every_switch_reads_its_value_the_same_way_compiled_or_not():
    """config's switch values (1, true, yes, on / 0, false, no, off; else a ValueError naming
    it) hold for every switch, whichever build runs: SHAREDMEM_TRACK_ORIGINS=false turned
    origin tracking on (anything but "" and "0" did), and a SHAREDMEM_REQUIRE_EXTENSION that
    is no switch value was ignored where the core is compiled (refused only where it is not)."""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import sharedmem.allocation as a; print(a.TRACK_ORIGINS)"
    base = {k: v for k, v in os.environ.items()
            if k not in ("SHAREDMEM_TRACK_ORIGINS", "SHAREDMEM_REQUIRE_EXTENSION")}
    base["PYTHONPATH"] = root

    def run(**env):
        return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                              text=True, env=dict(base, **env), cwd=root, timeout=120)
    for value, want in (("false", "False"), ("Off", "False"), ("0", "False"), ("", "False"),
                        ("1", "True"), ("yes", "True")):
        r = run(SHAREDMEM_TRACK_ORIGINS=value)
        assert (r.returncode, r.stdout.strip()) == (0, want), (value, r.stderr)
    for name in ("SHAREDMEM_TRACK_ORIGINS", "SHAREDMEM_REQUIRE_EXTENSION"):
        r = run(**{name: "maybe"})
        assert r.returncode != 0 and f"ValueError: {name}='maybe' is not a switch value: set " \
                                      f"it to 1 (true, yes, on) or 0 (false, no, off)" in r.stderr, \
            (name, r.stdout, r.stderr)


def test_the_modules_setup_py_compiles_are_the_ones_config_knows():
    # config.COMPILED_MODULES decides what SHAREDMEM_PURE_PYTHON loads from source and what
    # compiled() / SHAREDMEM_REQUIRE_EXTENSION check: a module missing there stays compiled
    import ast
    import os

    from sharedmem import config
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(root, "setup.py")):
        pytest.skip("needs the checkout (setup.py): an installed wheel's tests run without it")
    with open(os.path.join(root, "setup.py")) as f:
        tree = ast.parse(f.read())
    listed = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", None) == "COMPILED")
    paths = ast.literal_eval(listed)
    assert sorted(p[:-3].replace("/", ".") for p in paths) == sorted(config.COMPILED_MODULES)


def test_the_build_refuses_a_require_switch_that_is_no_switch_value():
    """setup.py read SHAREDMEM_REQUIRE_EXTENSION=maybe as off (it built, or warned, and went
    on), while importing sharedmem refuses that value (config._flag): the build now stops at
    once, naming it; 0 builds as unset does."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(root, "setup.py")):
        pytest.skip("needs the checkout (setup.py): an installed wheel's tests run without it")
    for value, refused in (("maybe", True), (" Off ", False)):
        env = dict(os.environ, SHAREDMEM_REQUIRE_EXTENSION=value)
        r = subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=120)
        said = f"SHAREDMEM_REQUIRE_EXTENSION={value!r} is not a switch value"
        assert (said in r.stderr) is refused and (r.returncode != 0) is refused, \
            (value, r.returncode, r.stderr[-500:])


def test_show_config_names_the_default_device_and_why_it_is_the_host(monkeypatch):
    import io

    import sharedmem.device as d
    monkeypatch.setattr(d, "_default", None)
    monkeypatch.delenv("SHAREDMEM_BACKEND", raising=False)

    def no_cuda(cls, ordinal=0):
        raise sm.BackendUnavailableError("the CUDA backend needs cuda-bindings (test)")
    monkeypatch.setattr(d, "Device", type("D", (), {"__new__": staticmethod(no_cuda),
                                                    "host": staticmethod(sm.Device.host)}))
    monkeypatch.setattr(d, "_fallback", [None])
    info = sm.show_config(io.StringIO())
    assert info["default device"] == ("<Device host> (CUDA unusable: the CUDA backend needs "
                                      "cuda-bindings (test))")
    assert d.host_fallback_reason() == "the CUDA backend needs cuda-bindings (test)"


def test_a_fallback_reason_is_forgotten_once_the_default_is_chosen_without_falling_back(
        monkeypatch):
    """show_config() asks for the default device without fixing it: where CUDA was unusable
    then (a GPU busy in exclusive-process mode), the reason stayed for good -- the next
    choice, CUDA device 0 once usable (or the host as SHAREDMEM_BACKEND=host asks),
    reported "<Device cuda:0 ...> (CUDA unusable: ...)", and host_fallback_reason() said
    why it had fallen back although it had not. The reason is the last choice's."""
    import io

    import sharedmem.device as d
    monkeypatch.setattr(d, "_default", None)
    monkeypatch.setattr(d, "_fallback", [None])
    monkeypatch.delenv("SHAREDMEM_BACKEND", raising=False)
    gpu = object.__new__(sm.Device)
    gpu._setup("cuda", 0, "Stand-in GPU", ("stand-in", 0), sm.Device.host().backend)
    busy = [True]

    def device0(cls, ordinal=0):
        if busy[0]:
            raise sm.CudaError("cuDevicePrimaryCtxRetain: CUDA_ERROR_DEVICE_BUSY", 46)
        return gpu
    monkeypatch.setattr(d, "Device", type("D", (), {"__new__": staticmethod(device0),
                                                    "host": staticmethod(sm.Device.host)}))
    info = sm.show_config(io.StringIO())
    assert info["default device"].startswith("<Device host> (CUDA unusable: CUDA device 0 is "
                                             "not usable: ")
    assert d._default is None  # (asking fixed nothing)
    busy[0] = False
    assert sm.default_device() is gpu
    assert d.host_fallback_reason() is None
    assert sm.show_config(io.StringIO())["default device"] == repr(gpu)
    monkeypatch.setattr(d, "_default", None)
    busy[0] = True
    assert sm.default_device() is sm.Device.host() and d.host_fallback_reason() is not None
    monkeypatch.setattr(d, "_default", None)
    monkeypatch.setenv("SHAREDMEM_BACKEND", "host")
    assert sm.default_device() is sm.Device.host() and d.host_fallback_reason() is None


def test_check_required_refuses_or_warns_about_an_interpreted_core(monkeypatch):
    """Interpreted: ``SHAREDMEM_REQUIRE_EXTENSION=1`` makes it an ImportError naming what
    runs from source and that SHAREDMEM_PURE_PYTHON is set; unasked for (neither variable),
    a SharedMemWarning says how to build it; asked for, nothing is said. Compiled: silent."""
    import warnings

    from sharedmem import config
    monkeypatch.setattr(config, "_interpreted", lambda: ["sharedmem.access"])
    monkeypatch.setenv("SHAREDMEM_REQUIRE_EXTENSION", "1")
    monkeypatch.setenv("SHAREDMEM_PURE_PYTHON", "1")
    with pytest.raises(ImportError, match=r"^SHAREDMEM_REQUIRE_EXTENSION=1, but the compiled core "
                                          r"is not in use \(sharedmem\.access run from source; "
                                          r"SHAREDMEM_PURE_PYTHON is set\)\. Build it"):
        config.check_required()
    monkeypatch.setenv("SHAREDMEM_REQUIRE_EXTENSION", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.check_required()  # asked for: nothing said
    monkeypatch.delenv("SHAREDMEM_PURE_PYTHON")
    with pytest.warns(sm.SharedMemWarning, match=r"^sharedmem: the compiled core is not built "
                                                 r"here, so it runs interpreted"):
        config.check_required()
    monkeypatch.setattr(config, "_interpreted", lambda: [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.check_required()


def test_the_source_finder_swaps_a_compiled_module_for_the_source_beside_it(tmp_path):
    """SHAREDMEM_PURE_PYTHON's finder: for a compiled module (an extension file) it gives the
    ``.py`` beside it; without one, the extension itself; a source found first is kept, and
    a module setup.py does not compile is left to the other finders."""
    import importlib.machinery

    from sharedmem import config
    find = config._SourcesFirst.find_spec
    ext = tmp_path / f"access{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    ext.write_bytes(b"")  # (never loaded: finding reads names only)
    spec = find("sharedmem.access", [str(tmp_path)])
    assert spec.name == "sharedmem.access" and spec.origin == str(ext)  # no source: compiled
    (tmp_path / "access.py").write_text("X = 1\n")
    spec = find("sharedmem.access", [str(tmp_path)])
    assert spec.name == "sharedmem.access" and spec.origin == str(tmp_path / "access.py")
    assert isinstance(spec.loader, importlib.machinery.SourceFileLoader)
    ext.unlink()
    assert find("sharedmem.access", [str(tmp_path)]).origin == str(tmp_path / "access.py")
    assert find("sharedmem.buffer", [str(tmp_path)]) is None  # nothing there
    assert find("sharedmem.ipc", [str(tmp_path)]) is None  # not a compiled module


def test_a_core_module_that_cannot_be_found_counts_as_interpreted(monkeypatch):
    from sharedmem import config
    assert config._origin("no_such_package_sm.mod") == ""  # (its package cannot be imported)
    assert config._origin("") == ""  # (find_spec's ValueError)
    monkeypatch.setattr(config, "COMPILED_MODULES", ("no_such_package_sm.mod",))
    assert config._interpreted() == ["no_such_package_sm.mod"] and config.compiled() is False


def test_show_config_says_why_there_is_no_default_device_and_chooses_none(monkeypatch):
    import io

    import sharedmem.device as d
    monkeypatch.setattr(d, "_default", None)
    monkeypatch.setenv("SHAREDMEM_BACKEND", "gpu")
    out = io.StringIO()
    info = sm.show_config(out)
    assert info["default device"] == ("none (SHAREDMEM_BACKEND='gpu' is not a backend; use "
                                      "'host' or 'cuda' (or unset it))")
    assert out.getvalue().splitlines()[-1] == "default device  " + info["default device"]
    assert d._default is None  # (asking fixes no choice)


def test_the_build_switches_read_false_as_off_and_refuse_what_is_no_switch(monkeypatch):
    """SHAREDMEM_PURE_PYTHON=false ran the interpreted core (about 3x slower per launch,
    nothing said): any value but "" and "0" was on. Now 1/true/yes/on is on, 0/false/no/off
    (and unset) off, in any case; anything else a ValueError naming the variable."""
    from sharedmem import config
    for value, on in (("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                      ("", False), ("0", False), ("false", False), ("No", False),
                      ("off", False)):
        monkeypatch.setenv("SHAREDMEM_PURE_PYTHON", value)
        assert config.pure_python_requested() is on, value
    monkeypatch.setenv("SHAREDMEM_PURE_PYTHON", "maybe")
    with pytest.raises(ValueError, match=r"^SHAREDMEM_PURE_PYTHON='maybe' is not a switch "
                                         r"value: set it to 1 \(true, yes, on\) or 0 \(false, "
                                         r"no, off\), or unset it$"):
        config.pure_python_requested()


def test_a_partly_built_or_stale_core_runs_interpreted_and_says_why(monkeypatch, tmp_path):
    """A module that failed to compile left the others compiled against a source they do
    not load beside ("size changed" at import, a ValueError); in a checkout, an edit not
    rebuilt ran the old code compiled and the new one interpreted, silently. Either way the
    whole core now runs interpreted, and the warning (and show_config) says why."""
    import os

    from sharedmem import config
    monkeypatch.setattr(config, "_unusable", None)
    origins = {m: f"/nowhere/{m}.so" for m in config.COMPILED_MODULES}
    origins["sharedmem.runtime.state"] = "/nowhere/state.py"
    monkeypatch.setattr(config, "_origin", origins.get)
    assert config.unusable_build() == ("it is partly built: sharedmem.runtime.state not "
                                       "compiled")
    (tmp_path / "setup.py").write_text("")  # a checkout
    pkg = tmp_path / "sharedmem"
    pkg.mkdir()
    ext, src = pkg / "buffer.cpython-3x.so", pkg / "buffer.py"
    ext.write_text("")
    src.write_text("")
    os.utime(ext, (1000, 1000))
    os.utime(src, (2000, 2000))
    monkeypatch.setattr(config, "_ROOT", str(tmp_path))
    monkeypatch.setattr(config, "_origin", lambda m: str(ext) if m == "sharedmem.buffer"
                        else f"/nowhere/{m}.so")
    monkeypatch.setattr(config, "_unusable", None)
    why = ("it is older than its sources (sharedmem.buffer changed since it was built): "
           "rebuild it (make build)")
    assert config.unusable_build() == why
    monkeypatch.setattr(config, "_interpreted", lambda: ["sharedmem.buffer"])
    monkeypatch.delenv("SHAREDMEM_PURE_PYTHON", raising=False)
    monkeypatch.delenv("SHAREDMEM_REQUIRE_EXTENSION", raising=False)
    with pytest.warns(sm.SharedMemWarning, match=r"^sharedmem: the compiled core cannot run "
                                                 r"here \(it is older than its sources"):
        config.check_required()
    monkeypatch.setenv("SHAREDMEM_REQUIRE_EXTENSION", "1")
    with pytest.raises(ImportError, match=r"run from source; it is older than its sources"):
        config.check_required()
    for undo in (lambda: os.utime(src, (500, 500)),  # rebuilt since
                 lambda: (tmp_path / "setup.py").unlink()):  # installed: not looked at
        undo()
        monkeypatch.setattr(config, "_unusable", None)
        assert config.unusable_build() is None
