"""Review of the torch and JAX interop paths (DLPack import / export, adopt, host launches).
Each test failed before its fix. Tests that need torch import it themselves and skip where it
is absent (the project's venv has none: run them with a venv that has torch)."""

import gc

import numpy as np
import pytest

import sharedmem as sm


def test_adopt_refuses_a_torch_tensor_over_memory_torch_does_not_own(host):
    """adopt() of a torch tensor checked its ``_base`` and its storage's use count, but a
    storage over memory torch did not allocate (torch.from_numpy, torch.frombuffer,
    torch.from_dlpack) counts one use while the NumPy array / buffer / producer that owns the
    memory still reaches it: the adoption succeeded, into_buffer() then made a Buffer said to
    be unique, and writes through the NumPy array changed it (silent aliasing)."""
    torch = pytest.importorskip("torch")
    a = np.arange(8, dtype=np.float32)
    owners = {"from_numpy": lambda: torch.from_numpy(a),
              "frombuffer": lambda: torch.frombuffer(bytearray(16), dtype=torch.float32),
              "from_dlpack": lambda: torch.from_dlpack(a)}
    sm.synchronize()
    for _ in range(4):  # (earlier tests' garbage goes first: the count compared is this test's)
        gc.collect()
    before = sm.stats().live_allocations
    for name, make in owners.items():
        with pytest.raises(sm.AliasError) as e:
            sm.adopt(make())
        assert str(e.value) == (
            f"cannot adopt a torch tensor (shape {tuple(make().shape)}, torch.float32) whose "
            f"storage torch does not show it owns alone: one over another object's memory "
            f"(torch.from_numpy, torch.frombuffer, torch.from_dlpack), whose owner still "
            f"reaches it, or one given to NumPy once (x.numpy()). Use sharedmem.from_dlpack to "
            f"share it, or adopt a copy (x.clone())."), name
        gc.collect()
        assert sm.stats().live_allocations == before, name  # nothing imported
    # the NumPy array still owns its memory, unchanged; a copy is adopted as before
    assert a.tolist() == list(range(8))
    t = sm.adopt(torch.from_numpy(a).clone())
    assert t.into_buffer().to_host().tolist() == list(range(8))


def test_adopt_of_a_torch_tensor_given_to_numpy_is_refused_for_good(host):
    """x.numpy() shares x's storage with a NumPy array; while it lives the use count refuses
    adopt(x). torch marks the storage not resizable from then on -- as it marks one over
    another owner's memory, which adopt() must refuse -- so adopt(x) stays refused (naming
    the remedy) after the array is dropped: conservative, as exclusivity cannot be shown."""
    torch = pytest.importorskip("torch")
    x = torch.arange(4.0)
    keep = x.numpy()
    with pytest.raises(sm.AliasError, match="storage other tensors"):
        sm.adopt(x)
    del keep
    with pytest.raises(sm.AliasError, match=r"or one given to NumPy once \(x\.numpy\(\)\)\. Use "
                                            r"sharedmem\.from_dlpack to share it, or adopt a copy"):
        sm.adopt(x)
    assert sm.adopt(x.clone()).into_buffer().to_host().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_float8_e5m2_view_is_refused_by_dlpack_before_any_hold(host):
    """ml_dtypes' float8_e5m2 says kind "f" (its other 8-bit floats say "V" and never reach
    device memory): _dl_dtype exported it as (kDLFloat, 8 bits), a type DLPack 1.0 does not
    have -- torch ("Unsupported kFloat bits 8") and JAX (UNIMPLEMENTED) refused the capsule
    only after the export had taken its hold and made it. Refused by the export now, with
    BufferError naming the dtype, taking no hold; the view stays usable."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    vals = np.array([1.5, -2.0, 0.25, 3.0], dtype=ml_dtypes.float8_e5m2)
    t = sm.Tensor.from_host(vals, device=host)
    views = list(t.allocation.views())
    msg = ("dtype float8_e5m2 has no DLPack 1.0 equivalent: DLPack's floats (kDLFloat) are "
           "IEEE float16, float32 and float64; copy to float16 or float32 first")
    for kw in ({}, {"max_version": (1, 0)}, {"copy": True}):
        with pytest.raises(BufferError) as e:
            t.__dlpack__(**kw)
        assert str(e.value) == msg, kw
        gc.collect()
        assert list(t.allocation.views()) == views  # no hold taken
    t.into_buffer()  # (nothing else holds the bytes: the move succeeds)


def test_a_float8_e5m2_view_is_refused_before_torch_reads_the_capsule(host):
    """The same through torch.from_dlpack: torch sees sharedmem's BufferError, not its own
    "Unsupported kFloat bits 8" about a capsule sharedmem should never have made."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    torch = pytest.importorskip("torch")
    t = sm.Tensor.from_host(np.zeros(4, dtype=ml_dtypes.float8_e5m2), device=host)
    with pytest.raises(BufferError, match=r"^dtype float8_e5m2 has no DLPack 1\.0 equivalent"):
        torch.from_dlpack(t)
    gc.collect()
    assert t.allocation.views() == ["tensor, bytes [0, 4) of allocation "
                                    f"#{t.allocation.id}"]
