# mypy: disable-error-code="attr-defined,union-attr"
# (torch.ones() and the rest return mesh tensors under activate(): a torch.Tensor
# subclass with Monarch's reduce, to_mesh, slice_mesh, stream; torch's stubs say Tensor)
"""Monarch's tensor-engine tests, ported: ``python/tests/test_controller.py`` and
``python/tests/test_remote_functions.py`` (meta-pytorch/monarch @ 3fc0a66e).

Imports changed (``monarch`` read as ``monarch_kernel``), ``cuda`` read as ``cpu``, and
Monarch's ``local_device_mesh(hosts, gpus)`` served by slices of one real 2x2 mesh
(``host`` x ``gpu``, started without a kernel) shared by the module. The worker-side
helpers Monarch keeps in ``monarch.worker._testing_function`` are the functions at the
end of this file (the ranks import them from here). Tests of what differs here
(parallel streams, the debugger, CUDA devices, Monarch's internal helpers) are skipped
with the reason. Every test's body is Monarch's.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
import re

import pytest
import torch

import monarch_kernel as monarch
from monarch_kernel import (
    OpaqueRef,
    Stream,
    Tensor,
    call_on_shard_and_fetch,
    fetch_shard,
    grad_function,
    grad_generator,
    inspect,
    remote,
)
from monarch_kernel.builtins.log import log_remote
from monarch_kernel.builtins.random import set_manual_seed_remote
from monarch_kernel.mesh_controller import RemoteException, spawn_tensor_engine
from monarch_kernel.tensor_engine import DeviceMesh, no_mesh
from monarch_kernel.tensor_engine import opaque as opaque_ref
from monarch_kernel.tensor_engine import remote_functions as remote_module
from monarch_kernel.tensor_engine.opaque import OpaqueModule, OpaqueObject, opaque_method
from monarch_kernel.tensor_engine.remote_autograd import remote_autograd_function

_HERE = __name__


@pytest.fixture(scope="module")
def pm():
    """A 2x2 mesh (``host`` x ``gpu``) shared by the module; checked for orphans after."""
    from conftest import local_mesh

    yield from local_mesh({"host": 2, "gpu": 2})


@pytest.fixture
def local(pm):
    """Monarch's ``TestingContext``: ``local.local_device_mesh(hosts, gpus, activate)``."""
    return _Local(pm)


class _Local:
    def __init__(self, pm):
        self.dm = spawn_tensor_engine(pm)

    @contextlib.contextmanager
    def local_device_mesh(self, hosts, gpus, activate=True):
        mesh = self.dm.slice(host=slice(0, hosts), gpu=slice(0, gpus))
        if not activate:
            yield mesh
            return
        with mesh.activate():
            yield mesh


# -- test_controller.py --------------------------------------------------------------------


def test_errors(local):
    t = torch.rand(3, 4)
    with local.local_device_mesh(2, 2) as device_mesh:
        y = torch.rand(3, 4)
        with pytest.raises(TypeError, match="LOCAL_TENSOR"):
            t.add(y)
        with pytest.raises(TypeError, match="WRONG_MESH"):  # noqa: PT012 (Monarch's)
            sm = device_mesh.slice(host=0)
            with sm.activate():
                x = torch.rand(3, 4)
                x.add(y)

        other = Stream("other")
        t = torch.rand(10).cuda()
        with pytest.raises(TypeError, match="WRONG_STREAM"), other.activate():
            t = t.reduce("host", "sum")


def test_sub_mesh(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        h0 = device_mesh.slice(host=0)
        h1 = device_mesh.slice(host=1)
        with h0.activate():
            _ = torch.rand(3, 4)
        with h1.activate():
            _ = torch.rand(3, 4)
            # Runs on a different mesh but should still work


def test_fetch_result_device(local):
    with local.local_device_mesh(2, 2):
        on_gpu = torch.ones(2, 3, device="cuda")
        on_cpu = torch.ones(2, 3, device="cpu")

        on_gpu_local = fetch_shard(on_gpu).result()
        on_cpu_local = fetch_shard(on_cpu).result()

    assert on_gpu_local.device == torch.device("cpu")
    assert on_cpu_local.device == torch.device("cpu")


def test_dim1_mesh(local):
    with local.local_device_mesh(2, 2, activate=False) as device_mesh:
        mesh3d = device_mesh.split(host=("oh", "ih"), ih=1)
        with mesh3d.activate():
            x = torch.ones(3, 4)
            local_x = fetch_shard(x).result()

    assert torch.equal(local_x, torch.ones(3, 4))


def test_sub_mesh_use_only_one(local):
    with local.local_device_mesh(2, 2, activate=False) as device_mesh:
        h0 = device_mesh.slice(host=0)

        with h0.activate():
            x = torch.ones(3, 4)
            local_x = fetch_shard(x)

        local_x = local_x.result(timeout=20)
        assert torch.equal(local_x, torch.ones(3, 4))


def test_sub_mesh_process_grop(local):
    with local.local_device_mesh(2, 2, activate=False) as device_mesh:
        h0 = device_mesh.slice(host=0)
        pg0 = h0.process_group(("gpu",))
        pg1 = h0.process_group(("gpu",))
        assert pg0 != pg1


def test_reduce(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        x = (
            12 * 2 * device_mesh.rank("host")
            + 12 * device_mesh.rank("gpu")
            + torch.arange(12, device="cuda").reshape(3, 4)
        )
        y = x.reduce("gpu", "sum")
        g = x.reduce("gpu", "stack")
        with pytest.raises(TypeError, match="When scattering"):
            x = x.reduce("gpu", "sum", scatter=True)
        x = x.reshape(2, 6)
        atoa = x.reduce("gpu", "stack", scatter=True)
        rs = x.reduce("gpu", "sum", scatter=True)
        rad = x.reduce((), "sum")
        rade = x.reduce(("gpu", "host"), "sum")
        with pytest.raises(ValueError, match="is not valid for multiple dimensions"):
            x.reduce((), "sum", scatter=True)
        with pytest.raises(ValueError, match="is not valid for multiple dimensions"):
            x.reduce((), "stack")
        with pytest.raises(ValueError, match="is not valid for multiple dimensions"):
            x.reduce((), "stack", scatter=True)
        y_local = fetch_shard(y).result()
        g_local = fetch_shard(g).result()
        # TODO compute the expected values to compare agains in the below section
        _ = fetch_shard(atoa).result()
        _ = fetch_shard(rs).result()
        rad_local = fetch_shard(rad).result()
        rade_local = fetch_shard(rade).result()

    xs = {
        (h, g): 12 * 2 * h + 12 * g + torch.arange(12, device="cpu").reshape(3, 4)
        for h, g in itertools.product(range(2), range(2))
    }

    y_expected = xs[(0, 0)] + xs[(0, 1)]
    g_expected = torch.stack([xs[(0, 0)], xs[(0, 1)]])
    assert torch.equal(y_local, y_expected)
    assert torch.equal(g_local, g_expected)
    rad_expected = (xs[(0, 0)] + xs[(0, 1)] + xs[(1, 0)] + xs[(1, 1)]).reshape(rad_local.shape)
    assert torch.equal(rad_local, rad_expected)
    assert torch.equal(rade_local, rad_expected)

    # test is run on 4 GPUs, can't have mesh with 3 non-trivial dimensions
    with local.local_device_mesh(2, 2, activate=False) as mesh2d:
        device_mesh = mesh2d.split(host=("oh", "ih"), ih=1)
        with device_mesh.activate():
            x = (
                12 * 2 * device_mesh.rank("oh")
                + 12 * device_mesh.rank("gpu")
                + torch.arange(12, device="cuda").reshape(3, 4)
            )
            y = x.reduce(("ih", "gpu"), "sum")
            y_local = fetch_shard(y).result()
            z = x.reduce(("oh", "gpu"), "sum")
            z_local = fetch_shard(z).result()

    assert torch.equal(y_local, y_expected)
    assert torch.equal(z_local, rad_expected.reshape(z_local.shape))


def test_reduce_out(local):
    with local.local_device_mesh(2, 2):
        inp = torch.rand(2, 4, device="cuda")
        out_incorrect = torch.rand(2, 4, device="cuda")
        out = torch.rand(4, device="cuda")

        with pytest.raises(ValueError, match="Reduce expects the shape to be torch.Size."):
            _ = inp.reduce("host", reduction="sum", scatter=True, out=out_incorrect)

        reduce_out = inp.reduce("host", reduction="sum", scatter=True)
        local_out = fetch_shard(out).result()
        local_reduce_out = fetch_shard(reduce_out).result()
        assert out._fake is not reduce_out._fake
        with no_mesh.activate():
            assert not torch.equal(local_out, local_reduce_out)

        reduce_out = inp.reduce("host", reduction="sum", scatter=True, out=out)
        local_out = fetch_shard(out).result()
        local_reduce_out = fetch_shard(reduce_out).result()
        assert out._fake is reduce_out._fake
        with no_mesh.activate():
            assert torch.equal(local_out, local_reduce_out)


def test_fetch(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        h = device_mesh.rank("host")
        g = device_mesh.rank("gpu")
        for hi in range(2):
            for gi in range(2):
                x, y = fetch_shard((h, g), {"host": hi, "gpu": gi}).result()
                with no_mesh.activate():
                    assert (hi, gi) == (x.item(), y.item())


def test_mutate(local):
    with local.local_device_mesh(2, 2):
        x = torch.rand(3, 4).cuda()
        x.abs_()
        s = Stream("other")
        b, drop = s.borrow(x)
        with pytest.raises(TypeError, match="would be mutated"):
            x.abs_()
        with s.activate():
            _ = b.add(b)
        drop.drop()
        x.abs_()
        b, drop = s.borrow(x, mutable=True)
        with s.activate():
            b.abs_()
        drop.drop()
        # del b
        x.abs_()


def test_movement(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        sm0 = device_mesh.slice(host=0)
        sm1 = device_mesh.slice(host=1)

        with sm0.activate():
            x = torch.rand(3, 4, device="cuda")
            _ = x.to_mesh(sm1)

        a = torch.rand(3, 4, device="cuda")

        b = a.slice_mesh(host=0)
        _ = b.to_mesh(sm0)
        _ = b.to_mesh(sm1)


def test_broadcast_one(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        for dim in ("host", "gpu"):
            subset = device_mesh.slice(**{dim: 1})
            with subset.activate():
                x = torch.rand(3, device="cuda")
                y = x.to_mesh(device_mesh)

            with subset.activate():
                a = monarch.inspect(x)
            with device_mesh.activate():
                b = monarch.inspect(y.reduce(dim, reduction="stack"))
            with no_mesh.activate():
                assert torch.allclose(a.expand(2, -1), b, rtol=0, atol=0)


def test_broadcast_two(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        subset = device_mesh.slice(host=1, gpu=1)
        with subset.activate():
            x = torch.rand(3, device="cuda")
            y = x.to_mesh(device_mesh)

        with subset.activate():
            a = monarch.inspect(x)
        with device_mesh.activate():
            b = monarch.inspect(
                y.reduce("host", reduction="stack").reduce("gpu", reduction="stack")
            )
        with no_mesh.activate():
            assert torch.allclose(a.expand(2, 2, -1), b, rtol=0, atol=0)


def test_autograd(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        x = torch.rand(3, 4, requires_grad=True)
        y = torch.rand(4, 3, requires_grad=True)
        z = torch.rand(3, requires_grad=True)

        foo = (x @ y + z).sum()
        with no_mesh.activate():
            # check backward restores forward mesh
            for t in grad_generator(foo, [z, y, x]):
                with device_mesh.activate():
                    fetch_shard(t).result()


def test_mesh_semantics(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        host0 = device_mesh.slice(host=0)
        host1 = device_mesh.slice(host=1)
        with host0.activate():
            x = torch.randn(5)
        y = x * 5
        with host1.activate():
            a = torch.randn(5)
            b = a * 5
            x.cos()
        y.cos()
        b.cos()


def test_autograd_multi_mesh(local):
    @grad_function
    def to_mesh(x: Tensor, mesh: DeviceMesh):
        omesh = x.mesh

        def backward(grad_x: Tensor):
            print(grad_x.mesh, omesh)
            return grad_x.to_mesh(omesh), None

        return x.to_mesh(mesh), backward

    with local.local_device_mesh(2, 2) as device_mesh:
        host0 = device_mesh.slice(host=0)
        host1 = device_mesh.slice(host=1)
        with host0.activate():
            x = torch.rand(3, 4, requires_grad=True, device="cuda")
            y = torch.rand(4, 3, requires_grad=True, device="cuda")
            t = x @ y
            t = to_mesh(t, host1)
        with host1.activate():
            z = torch.rand(3, requires_grad=True, device="cuda")
            foo = (t + z).sum()

        for r in grad_generator(foo, [z, y, x]):
            with r.mesh.activate():
                print(fetch_shard(r).result())


def test_many(local):
    with local.local_device_mesh(2, 2):
        x = torch.rand(3, 4)
        for _ in range(2048):
            x = x + torch.rand(3, 4)
        fetch_shard(x).result()


@pytest.mark.skip(reason="monarch.common.tree.flattener is Monarch's internal helper")
def test_flattener():
    pass


def test_torch_tensor(local):
    with local.local_device_mesh(2, 2):
        t = torch.tensor([1, 2, 4])
        # cuda read as cpu: torch.tensor(data, device="cuda") needs CUDA in this process
        tc = torch.tensor([1, 2, 4], device="cpu")
        t2 = fetch_shard(t).result()
        tc2 = fetch_shard(tc).result()
    assert torch.allclose(t2, torch.tensor([1, 2, 4]))
    assert torch.allclose(tc2, torch.tensor([1, 2, 4], device="cpu"))


def test_to_mesh_aliasing(local):
    with local.local_device_mesh(2, 2) as mesh:
        p2p_stream = Stream("p2p_stream")

        ppmesh = mesh.flatten("all").split(
            all=(
                "dp",
                "pp",
            ),
            pp=2,
        )
        pp_meshes = [ppmesh.slice(pp=i) for i in range(2)]

        with ppmesh.activate():
            with pp_meshes[0].activate():
                x = torch.randn((3, 3), device="cuda")
                x_borrowed_tensor, x_borrow = p2p_stream.borrow(x)
                with p2p_stream.activate():
                    y_on_mesh_1_p2p_stream = x_borrowed_tensor.to_mesh(pp_meshes[1])

            with pp_meshes[1].activate():
                x_borrow.drop()
                y_on_mesh_1_default_stream, y_borrow = monarch.get_active_stream().borrow(
                    y_on_mesh_1_p2p_stream
                )

                monarch.inspect(y_on_mesh_1_default_stream)
                y_borrow.drop()


def test_to_mesh_cow(local):
    with local.local_device_mesh(2, 2) as mesh:
        t = torch.zeros((), device="cuda")
        t2 = t.to_mesh(mesh)
        t.add_(1)
        assert monarch.inspect(t2).item() == 0
        assert monarch.inspect(t).item() == 1


def test_to_mesh_stream(local):
    other = monarch.Stream("other")
    with local.local_device_mesh(2, 2) as mesh:
        m0 = mesh.slice(host=0)
        m1 = mesh.slice(host=1)
        with m0.activate():
            t2 = torch.rand(3, 4, device="cuda").to_mesh(m1, stream=other)
        with m1.activate(), other.activate():
            # assert doesn't fail
            monarch.inspect(t2 + t2)


def test_dropped_trace(local):
    with local.local_device_mesh(2, 2) as _:
        x = torch.rand(4, 4).cuda()
        s = Stream("other")
        b, drop = s.borrow(x)
        drop.drop()
        with s.activate():
            pattern = re.compile(".*tensor.*is dropped at.*.*drop.drop().*", flags=re.DOTALL)
            with pytest.raises(TypeError, match=pattern):
                _ = b.abs()


def test_sub_mesh_reduce(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        host1 = device_mesh.slice(host=1)
        with host1.activate():
            myrank = (device_mesh.rank("host") + 1) * 2 + device_mesh.rank("gpu") + 1
            x = torch.ones((3, 4), device="cuda") * myrank
            reduce = x.reduce("gpu", "sum")
            local_reduce = fetch_shard(reduce).result()

    assert torch.equal(local_reduce, torch.ones(3, 4) * 11)


def test_size(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        assert device_mesh.size(["host", "gpu"]) == 4


def test_torch_op_with_optional_tensors(local):
    with local.local_device_mesh(2, 2):
        x = torch.rand(3, 4, device="cuda")
        # When bias and elementwise_affine are true, extra tensors are passed through optional
        # fields inside LayerNorm. When they are false, None is passed to the same optional fields.
        layer_norm_with_vals = torch.nn.LayerNorm(
            4, device="cuda", bias=True, elementwise_affine=True
        )
        layer_norm_with_none = torch.nn.LayerNorm(
            4, device="cuda", bias=False, elementwise_affine=False
        )
        monarch.inspect(layer_norm_with_vals(x))
        monarch.inspect(layer_norm_with_none(x))


def test_reduce_pytree(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        a = device_mesh.rank(("gpu", "host")) + torch.zeros((1,), device="cuda")
        b = device_mesh.rank(("gpu", "host")) + torch.ones((1,), device="cuda")

        tensor_dict = {"a": a, "b": b}
        _ = monarch.reduce_(tensor_dict, dims=("gpu", "host"), reduction="sum")
        reduced_tensor_dict = monarch.reduce(tensor_dict, dims=("gpu", "host"), reduction="sum")
        reduced_a = fetch_shard(reduced_tensor_dict["a"]).result()
        reduced_b = fetch_shard(reduced_tensor_dict["b"]).result()
        reduced_a_inplace = fetch_shard(tensor_dict["a"]).result()
        reduced_b_inplace = fetch_shard(tensor_dict["b"]).result()

    assert torch.equal(reduced_a_inplace, torch.tensor([6.0]))
    assert torch.equal(reduced_b_inplace, torch.tensor([10.0]))
    assert torch.equal(reduced_a, torch.tensor([24.0]))
    assert torch.equal(reduced_b, torch.tensor([40.0]))


def test_to_mesh_pytree(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        host0 = device_mesh.slice(host=0)
        host1 = device_mesh.slice(host=1)

        with host0.activate():
            a = torch.zeros((1,), device="cuda")
            b = torch.ones((1,), device="cuda")
            tensor_dict = {"a": a, "b": b}
            moved_tensor_dict = monarch.to_mesh(tensor_dict, host1)

        with host1.activate():
            moved_tensor_dict["a"].add_(1)
            moved_tensor_dict["b"].add_(1)

        moved_tensor_a = monarch.inspect(moved_tensor_dict["a"])
        moved_tensor_b = monarch.inspect(moved_tensor_dict["b"])

        host0.exit()
        host1.exit()

    assert torch.equal(moved_tensor_a, torch.tensor([1.0]))
    assert torch.equal(moved_tensor_b, torch.tensor([2.0]))


def test_hanging_error(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        remote(lambda: torch.rand(3) + torch.rand(4), propagate=lambda: None)()

        with pytest.raises(Exception, match="The size of tensor"):
            device_mesh.client.shutdown()


def test_slice_mesh_pytree(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        a = device_mesh.rank("host") + torch.zeros((1,), device="cuda")
        b = device_mesh.rank("host") + torch.ones((1,), device="cuda")

        tensor_dict = {"a": a, "b": b}
        host0_slices = monarch.slice_mesh(tensor_dict, host=0)
        host1_slices = monarch.slice_mesh(tensor_dict, host=1)

        host0 = device_mesh.slice(host=0)
        host1 = device_mesh.slice(host=1)

        host0_tensors = monarch.to_mesh(host0_slices, host0)
        host1_tensors = monarch.to_mesh(host1_slices, host1)

        with host0.activate():
            _ = monarch.reduce_(host0_tensors, dims=("gpu"), reduction="sum")
            host0_a = fetch_shard(host0_tensors["a"]).result()
            host0_b = fetch_shard(host0_tensors["b"]).result()

        with host1.activate():
            _ = monarch.reduce_(host1_tensors, dims=("gpu"), reduction="sum")
            host1_a = fetch_shard(host1_tensors["a"]).result()
            host1_b = fetch_shard(host1_tensors["b"]).result()

        host0.exit()
        host1.exit()

    assert torch.equal(host0_a, torch.tensor([0.0]))
    assert torch.equal(host0_b, torch.tensor([2.0]))
    assert torch.equal(host1_a, torch.tensor([2.0]))
    assert torch.equal(host1_b, torch.tensor([4.0]))


# Monarch's test_random_state ends the module: it turns deterministic algorithms on for
# every rank of the shared mesh.


# -- test_remote_functions.py --------------------------------------------------------------

rlist = remote("builtins.list", propagate=lambda elem: elem)


def _do_bogus_tensor_work_propagate(x, y, fail_rank=None):
    return x + y  # real function actually does x @ y


do_bogus_tensor_work = remote(
    f"{_HERE}.do_bogus_tensor_work_worker", propagate=_do_bogus_tensor_work_propagate
)

outer_remote_function_that_calls_inner = remote(
    f"{_HERE}.outer_remote_function_that_calls_inner_worker", propagate=lambda: torch.zeros(1)
)

opaque_ref_key_table_length = remote(
    f"{_HERE}.opaque_ref_key_table_length_worker", propagate=lambda: torch.zeros(1)
)

create_opaque_ref = remote(f"{_HERE}.create_opaque_ref_worker", propagate=lambda: OpaqueRef(None))


def test_hello(local):
    with local.local_device_mesh(2, 2):
        log_remote("hello, world")


def test_eager_remote_function_failed(local):
    with local.local_device_mesh(1, 2) as _:
        x = torch.rand(3, 4)
        y = torch.rand(3, 4)
        z = do_bogus_tensor_work(x, y, fail_rank=1)
        a = z + x
        with pytest.raises(RemoteException, match="do_bogus_tensor_work"):
            _ = fetch_shard(a).result(timeout=40)


@pytest.mark.skip(reason="torch.cuda.set_device: the ranks here have no CUDA devices")
def test_set_device_inside_udf_fails_with_explanation(local):
    pass


def test_simple_tensors(local):
    with local.local_device_mesh(2, 2):
        x = torch.rand(3, 4)
        y = x + x
        log_remote("%s %s", x, y)
        z = torch.std_mean(x)
        log_remote("%s", z)


def test_user_call(local):
    with local.local_device_mesh(2, 2) as _:
        x = torch.rand(3, 4)
        y = rlist((x + 1, x))
        log_remote("%s", y)


def test_remote_exception(local):
    with local.local_device_mesh(2, 2) as _:
        x = torch.rand(3, 4)
        y = torch.rand(3, 4)
        z = do_bogus_tensor_work(x, y)
        a = z + x
        b = x + y
        with pytest.raises(RemoteException, match="do_bogus_tensor_work"):
            _ = fetch_shard(a).result(timeout=20)
        # but values not dependent on z are fine
        fetch_shard(b).result(timeout=10)


def test_distributed_error(local):
    with local.local_device_mesh(2, 2) as _:
        x = torch.rand(3, 4).cuda()
        y = torch.rand(3, 4).cuda()
        # z is broken on rank 1 but not others
        z = do_bogus_tensor_work(x, y, fail_rank=1)
        # test that rank 1 is still doing work despite z failing
        a = (x + y).reduce("gpu")
        fetch_shard(a).result()
        # but z itself should fail, even if we do not fetch it from rank 1
        # (since fetch shard says we first want to assert the whole tensor is correct)
        with pytest.raises(RemoteException, match="do_bogus_tensor_work"):
            fetch_shard(z).result()
        # try to reduce z, which should fail, but ranks that are not 1 do not
        # know about the failure. Rank 1 should still participate in the reduce
        # to unblock work.
        rz = z.reduce("gpu")
        # but we should see the error message still retrieving it because it is
        # dependent on an error.
        with pytest.raises(RemoteException, match="do_bogus_tensor_work"):
            fetch_shard(rz).result()
        # however, we should still be able to compute and get a result back
        # from host 1, signaling that the reduction didn't get cuda compute stuck.
        fetch_shard(2 * x, gpu=1, host=0).result()


@pytest.mark.skip(
    reason="streams on CPU ranks are ordering domains run on one thread: two streams "
    "waiting on one barrier would wait forever"
)
def test_streams_run_parallel(local):
    pass


@pytest.mark.skip(reason="pdb on the ranks goes through the kernel's debugger, not Monarch's")
def test_debug(local):
    pass


def test_fetch_preprocess(local):
    with local.local_device_mesh(2, 2):
        assert (
            call_on_shard_and_fetch(
                remote(f"{_HERE}.do_some_processing"),
                "an argument",
            ).result()
            == "an argument processed"
        )


def test_cached_remote_function(local):
    fn = remote(f"{_HERE}.how_many_of_these_do_you_want")
    start_hits = remote_module._hit
    with local.local_device_mesh(2, 2):
        x = torch.ones(3, 4)
        y = torch.rand(3, 4)

        a, _, _ = fn(3, x)
        b, _, _ = fn(3, x)
        assert len(a._aliases.aliases) == 1
        assert len(b._aliases.aliases) == 1
        _, _, _ = fn(3, y)
        t0, t1 = fn(2, x)
        t0.add(t1)
        local_a = fetch_shard(a).result()
        with no_mesh.activate():
            assert torch.all(local_a == 1.0)

        end_hits = remote_module._hit
        assert end_hits - start_hits == 2


def test_remote_autograd_function(local):
    _testing_function = importlib.import_module(_HERE)

    remote_fn = remote_autograd_function(_testing_function.TestRemoteAutogradFunction)

    with local.local_device_mesh(1, 1):
        x = torch.ones(1, requires_grad=True)
        y = torch.ones_like(x).requires_grad_(True)
        outs = remote_fn.apply(x, y)
        assert outs[3] == 4
        local_0 = fetch_shard(outs[0]).result()
        local_1 = fetch_shard(outs[1]).result()
        (outs[0] + outs[1]).sum().backward()
        # unfortunately, grad_fn of local tensor is always None
        # regardless of whether we set `no_grad` on the worker
        # so we can test only requires_grad
        for ll in (local_0, local_1):
            assert not ll.requires_grad
        grad_local_0 = fetch_shard(x.grad).result()
        grad_local_1 = fetch_shard(x.grad).result()
        x = x.detach()
        x.grad = None
        y.grad = None
        outs = remote_fn.apply(x, y)
        local_0_f = fetch_shard(outs[0]).result()
        (outs[0] + outs[1]).sum().backward()
        assert x.grad is None
        grad_local_1_f = fetch_shard(y.grad).result()

    assert torch.equal(local_0_f, torch.full_like(local_0_f, 2))
    assert torch.equal(local_0, torch.ones_like(local_0))
    assert torch.equal(grad_local_0, torch.ones_like(local_0))
    assert torch.equal(grad_local_1, torch.ones_like(local_0))
    assert torch.equal(grad_local_1_f, torch.ones_like(local_0))  # (Monarch only fetches it)


def remote_chunk(t: torch.Tensor):
    """Monarch's ``_testing_function.remote_chunk``."""
    return t.chunk(4, dim=0)


def test_cached_remote_aliases(local):
    fn = remote(f"{_HERE}.remote_chunk")
    with local.local_device_mesh(1, 1):
        x = torch.randn(16, 5, device="cuda")
        outs = fn(x)
        aliases = outs[0]._aliases.aliases
        # x and 4 results of x.chunk(4)
        assert len(aliases) == 5
        assert outs[2]._fake.storage_offset() == 40


def test_live_function(local):
    def bar(x, y):
        return (
            a_function_called_by_a_live_function(x)
            + a_live_function_call_by_a_live_function(y)
            + math.pi
        )

    @remote
    def check(x):
        return torch.allclose(x, torch.zeros(()) + math.pi + 5)

    y = 7

    @monarch.remote
    def close():
        return y

    @monarch.remote
    def cuda_works(x):
        return x.cpu()  # cuda read as cpu: the ranks have no CUDA

    with local.local_device_mesh(2, 2):
        a = torch.ones(())
        assert call_on_shard_and_fetch(check, bar(a, a)).result()
        # ensure we do not attempt to pickle closures
        close()

        b = cuda_works(a)
        fetch_shard(b).result()

        @monarch.remote
        def something_else():
            raise Exception("No")  # this line appears

        # check that the stack trace has correct line numbers
        with pytest.raises(Exception, match=r"this line appears"):
            something_else()


def test_setting_random_seed(local):
    with local.local_device_mesh(2, 2):
        set_manual_seed_remote(12345)
        t = torch.randn(3, 4)
        t_d = torch.randn(3, 4, device="cuda")
        ref = fetch_shard(t).result()
        ref_d = fetch_shard(t_d).result()
        vals = {
            (h, d): fetch_shard(t, {"host": h, "gpu": d}).result()
            for h, d in itertools.product(range(2), repeat=2)
        }

        vals_d = {
            (h, d): fetch_shard(t_d, {"host": h, "gpu": d}).result()
            for h, d in itertools.product(range(2), repeat=2)
        }

    for v, v_d in zip(vals.values(), vals_d.values()):
        assert torch.equal(v, ref)
        assert torch.equal(v_d, ref_d)


def test_return_exception(local):
    @monarch.remote
    def simple():
        return Exception("is a valid value to return")

    with local.local_device_mesh(1, 1):
        # This should be a valid return than an exception to raise
        call_on_shard_and_fetch(simple).result()


def test_opaque_object(local):
    with local.local_device_mesh(2, 2):

        class Foo(OpaqueObject):
            @opaque_method
            def add(self, x: torch.Tensor):
                return x + x

        f = Foo(f"{_HERE}.WorkerFoo", 4.0)

        result = monarch.inspect(f.add(torch.ones(3, 4)))
        with monarch.no_mesh.activate():
            assert torch.allclose(torch.full((3, 4), 5.0), result)

        f.hi = 4
        assert f.hi == 4


def test_opaqueRef_key_deleted(local):
    with local.local_device_mesh(1, 1):
        ref = create_opaque_ref()
        assert inspect(opaque_ref_key_table_length()).item() == 1
        del ref
        assert inspect(opaque_ref_key_table_length()).item() == 0


def test_opaque_module(local):
    with local.local_device_mesh(2, 2):
        linear = OpaqueModule("torch.nn.Linear", 3, 3, device="cpu")  # cuda read as cpu
        with torch.no_grad():
            for p in linear.parameters():
                p.zero_()
        input_ = torch.rand(4, 3, device="cuda")
        # we should have been able to clear the parameters and have that result
        # affect how the linear works.
        output = linear.call_method("forward", lambda self, x: x.clone(), input_)
        assert monarch.inspect(output.sum()).item() == 0


def test_opaque_module_autograd(local):
    with local.local_device_mesh(2, 2):
        input_ = torch.rand(3, 3, device="cuda", requires_grad=True)

        linear = OpaqueModule("torch.nn.Linear", 3, 3, device="cpu")  # cuda read as cpu
        output = linear(input_, propagator=lambda self, x: x.clone())
        r = output.sum()
        with torch.no_grad():
            r.backward()

        weight, bias = linear.parameters()
        ig0, wg0, bg0 = monarch.inspect((input_.grad, weight.grad, bias.grad))

        input_.grad = None
        weight.grad = None
        bias.grad = None

        (input_ @ weight.T + bias).sum().backward()

        ig1, wg1, bg1 = monarch.inspect((input_.grad, weight.grad, bias.grad))

        with monarch.no_mesh.activate():
            assert torch.allclose(ig0, ig1)
            assert torch.allclose(wg0, wg1)
            assert torch.allclose(bg0, bg1)


def test_remote_function_failure_message_contains_traceback(local):
    with local.local_device_mesh(2, 2):
        x = outer_remote_function_that_calls_inner()
        with pytest.raises(RemoteException) as info:
            inspect(x)
        e = info.value
        assert "outer_remote_function" in e.worker_error_string
        assert "inner_remote_function" in e.worker_error_string


@remote
def return_them(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x, y)


def test_value_mesh(local):
    with local.local_device_mesh(2, 2, "mesh") as device_mesh:
        x = device_mesh.rank("host")
        y = device_mesh.rank("gpu")
        r = return_them.call(x, y).get()

    for p, (h, g) in r:
        assert p["host"] == h.item()
        assert p["gpu"] == g.item()


# -- last: it makes every rank of the shared mesh deterministic ------------------------------


def test_random_state(local):
    with local.local_device_mesh(2, 2) as device_mesh:
        monarch.random.make_deterministic()
        for device in ("cpu", "cuda"):
            a = monarch.random.get_state()
            monarch.inspect(a)
            first = torch.rand(1, device=device)
            monarch.random.set_state(a)
            second = torch.rand(1, device=device)
            f, s = monarch.inspect((first, second))
            with no_mesh.activate():
                assert torch.allclose(f, s, atol=0, rtol=1)
            seed = device_mesh.rank(["host", "gpu"]) + 4
            s2 = monarch.random.new_state(seed)
            s3 = monarch.random.new_state(seed)
            monarch.random.set_state(s2)
            r0 = torch.rand(1, device=device)
            if device == "cuda":
                for d in ("host", "gpu"):
                    r0 = r0.reduce(d, reduction="stack")
            monarch.random.set_state(s3)
            r1 = torch.rand(1, device=device)
            if device == "cuda":
                for d in ("host", "gpu"):
                    r1 = r1.reduce(d, reduction="stack")
            r2, r3 = monarch.inspect((r0, r1))
            monarch.random.set_state(a)
            with no_mesh.activate():
                assert torch.allclose(r2, r3, atol=0, rtol=0)
                assert not torch.allclose(r2, f, atol=0, rtol=0)


# -- what Monarch keeps in monarch.worker._testing_function (run on the ranks) ---------------


def do_bogus_tensor_work_worker(x, y, fail_rank=None):
    import os

    if fail_rank is not None and int(os.environ["RANK"]) != fail_rank:
        return x
    return x @ y


def do_some_processing(a_string):
    return a_string + " processed"


def how_many_of_these_do_you_want(n: int, t: torch.Tensor):
    return [t + i for i in range(n)]


def inner_remote_function_that_fails_worker():
    raise Exception("Failed to execute inner_remote_function_that_fails")


class TestRemoteAutogradFunction(torch.autograd.Function):
    __test__ = False  # (not a test class: Monarch's name)

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x)
        out0 = x * y if x.requires_grad else x + y
        return out0, y, torch.ones(4), 4

    @staticmethod
    def backward(ctx, dx1, dx2, dx3, dx4):
        return dx1, dx2


def create_opaque_ref_worker():
    return OpaqueRef(torch.nn.Linear(10, 10))


def opaque_ref_key_table_length_worker() -> torch.Tensor:
    return torch.tensor(len(list(opaque_ref._key_table.keys())))


class WorkerFoo:
    def __init__(self, v):
        self.t = torch.full((), v)

    def add(self, b):
        return self.t + b


def outer_remote_function_that_calls_inner_worker():
    inner_remote_function_that_fails_worker()
    return torch.zeros(1)


def a_function_called_by_a_live_function(x):
    return 2 * x


def a_live_function_call_by_a_live_function(x):
    return 3 * x
