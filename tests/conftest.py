"""Fixtures every test folder can use, and the suite's network guard.

How the tests share code (one rule):

* **Fixtures** -- anything with setup and teardown, per-session caching, or autouse behaviour -- live
  in ``conftest.py`` files: this one for what several folders use (tiny models, tiny pipelines on
  disk, the network guard), ``tests/<folder>/conftest.py`` for what only that folder uses. Tests get
  a fixture by naming it as an argument, never by importing it; autouse fixtures apply by themselves.
* **Helpers** -- plain functions, classes and constants that tests call with arguments -- live in the
  ``tests/helpers/`` package, one module per topic, imported as ``from helpers.models import
  wan_inputs`` (``tests/`` is on ``sys.path`` through ``pythonpath`` in ``pyproject.toml``).
* Test modules import neither ``conftest`` nor each other; ``conftest.py`` files may import helpers.
  Test modules are imported with ``--import-mode=importlib``, so their basenames need not be unique.

Network: :func:`no_outbound_network` (autouse, whole session) makes every connection from the test
process to a non-loopback address, and every name lookup other than this machine's, fail with an
``AssertionError``. Loopback stays open (the web tests' local server, torch.distributed's rendezvous);
subprocesses are not patched, they get ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` from here.
"""

from __future__ import annotations

import ipaddress
import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# On some CPUs (seen on AMD EPYC) MKL's float32 matmul rounds differently depending on its operands' memory
# alignment, and a memory-mapped weight sits at its offset in the safetensors file (8-byte aligned): the same
# weights then give outputs ~5e-7 apart loaded mapped or copied. MKL's strict reproducibility mode removes the
# dependence, so the bit-exact reload tests test the loading, not the CPU. Read when MKL first runs: set it here,
# before torch (subprocesses inherit it).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# Inductor's on-disk graph cache keys a compiled graph without TRITON_INTERPRET, yet the fused op's fake outputs
# (the block summaries it keeps) depend on it: a graph compiled by another process with the interpreter on (a
# developer's session, the GPU session's smoke run) would be reused with it off and fail. The suite keeps its own
# cache, where every compile runs with the interpreter off (the compile tests unset it), warm across runs.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"torchinductor-mhla-tests-{os.getuid() if hasattr(os, 'getuid') else 0}"
)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.register_assert_rewrite("helpers")  # before any helper module is imported: their asserts explain failures too

from helpers.models import dit_inputs, wan_inputs  # noqa: E402
from mhla_diffusion.models.tiny import tiny_dit_transformer, tiny_wan_transformer  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

# ----------------------------------------------------------------------------- network guard

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", socket.gethostname().lower()}


def _is_local_host(host) -> bool:
    """Loopback / unspecified addresses and this machine's own names (no lookup is made)."""
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if not isinstance(host, str):
        return False
    host = host.strip("[]").split("%", 1)[0].lower()  # "[::1]", "fe80::1%eth0"
    if host in _LOCAL_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if getattr(address, "ipv4_mapped", None) is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified


def _refuse(what: str, target) -> None:
    raise AssertionError(f"tests must not use the network: {what} {target!r} (only loopback is allowed)")


@pytest.fixture(scope="session", autouse=True)
def no_outbound_network():
    """Every test, and every fixture, runs with outbound network blocked in this process.

    Patched: ``socket.socket.connect`` / ``connect_ex`` / ``sendto`` for IPv4 and IPv6 sockets to a
    non-loopback address (``socket.create_connection``, ``urllib``, ``http.client``, ``requests``,
    ``httpx`` and ``asyncio`` all connect through these), and ``socket.getaddrinfo`` /
    ``gethostbyname`` / ``gethostbyname_ex`` for names other than this machine's (a DNS lookup is
    network traffic too). Unix-domain and other socket families are left alone.
    """
    real_connect, real_connect_ex, real_sendto = socket.socket.connect, socket.socket.connect_ex, socket.socket.sendto
    real_getaddrinfo, real_gethostbyname, real_gethostbyname_ex = (
        socket.getaddrinfo,
        socket.gethostbyname,
        socket.gethostbyname_ex,
    )
    internet = (socket.AF_INET, socket.AF_INET6)

    def connect(self, address):
        if self.family in internet and not _is_local_host(address[0]):
            _refuse("connect to", address)
        return real_connect(self, address)

    def connect_ex(self, address):
        if self.family in internet and not _is_local_host(address[0]):
            _refuse("connect to", address)
        return real_connect_ex(self, address)

    def sendto(self, data, *args):
        address = args[-1]  # sendto(data, address) or sendto(data, flags, address)
        if self.family in internet and not _is_local_host(address[0]):
            _refuse("send to", address)
        return real_sendto(self, data, *args)

    def getaddrinfo(host, *args, **kwargs):
        if not _is_local_host(host):
            _refuse("look up", host)
        return real_getaddrinfo(host, *args, **kwargs)

    def gethostbyname(host):
        if not _is_local_host(host):
            _refuse("look up", host)
        return real_gethostbyname(host)

    def gethostbyname_ex(host):
        if not _is_local_host(host):
            _refuse("look up", host)
        return real_gethostbyname_ex(host)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", connect)
        patch.setattr(socket.socket, "connect_ex", connect_ex)
        patch.setattr(socket.socket, "sendto", sendto)
        patch.setattr(socket, "getaddrinfo", getaddrinfo)
        patch.setattr(socket, "gethostbyname", gethostbyname)
        patch.setattr(socket, "gethostbyname_ex", gethostbyname_ex)
        yield


# ----------------------------------------------------------------------------- tiny models and inputs


@pytest.fixture
def tiny_wan():
    """A 3-layer tiny WanTransformer3DModel (fresh per test)."""
    return tiny_wan_transformer(num_layers=3)


@pytest.fixture
def tiny_dit():
    """A 2-layer tiny DiTTransformer2DModel (fresh per test)."""
    return tiny_dit_transformer(num_layers=2)


@pytest.fixture
def wan_batch():
    return wan_inputs()


@pytest.fixture
def dit_batch():
    return dit_inputs()


# ----------------------------------------------------------------------------- tiny pipelines on disk


@pytest.fixture(scope="session")
def pipeline_dirs(tmp_path_factory):
    """Tiny Wan and DiT pipelines saved to disk, with MHLA weights folders for them.

    Keys: ``wan`` / ``dit`` (stock Diffusers pipeline folders), ``wan_mhla`` / ``dit_mhla``
    (``save_mhla`` folders; Wan with a (2, 2, 2) layout, DiT with its auto 2x2 layout).
    """
    from mhla_diffusion import MHLAConfig, convert_to_mhla, save_mhla
    from mhla_diffusion.models.tiny import TINY_ID2LABEL, tiny_dit_pipeline, tiny_wan_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    wan = tiny_wan_pipeline()
    wan.save_pretrained(root / "wan")
    convert_to_mhla(wan.transformer, MHLAConfig(layout=(2, 2, 2), gate=True))
    with torch.no_grad():
        wan.transformer.blocks[0].attn1.processor.mixing.mul_(1.5)
    save_mhla(wan.transformer, root / "wan_mhla")

    dit = tiny_dit_pipeline()
    dit.register_to_config(id2label=TINY_ID2LABEL)  # so the stock pipeline saves it
    dit.save_pretrained(root / "dit")
    convert_to_mhla(dit.transformer, MHLAConfig(lepe=True))
    save_mhla(dit.transformer, root / "dit_mhla")
    return {name: root / name for name in ("wan", "wan_mhla", "dit", "dit_mhla")}


@pytest.fixture(scope="session")
def causal_pipeline_dir(tmp_path_factory):
    """A tiny Wan pipeline whose transformer is block-causal MHLA (``helpers.streaming.causal_tiny_pipeline``),
    saved whole with ``save_pretrained``: ``MHLAWanStreamingPipeline.from_pretrained(folder)`` and
    ``mhla text-to-video --stream --model folder`` load it."""
    from helpers.streaming import causal_tiny_pipeline

    folder = tmp_path_factory.mktemp("pipelines") / "wan_causal"
    causal_tiny_pipeline().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def block_causal_softmax_dir(tmp_path_factory):
    """A tiny Wan pipeline whose softmax self-attention is block-causal over latent frames with a KV cache
    (``helpers.streaming.block_causal_softmax_pipeline``; its transformer config records it), saved whole:
    ``MHLAWanStreamingPipeline.from_pretrained(folder)`` and ``mhla text-to-video --stream --attention softmax
    --model folder`` stream it."""
    from helpers.streaming import block_causal_softmax_pipeline

    folder = tmp_path_factory.mktemp("pipelines") / "wan_block_causal_softmax"
    block_causal_softmax_pipeline().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def long_video_root(tmp_path_factory):
    """A folder laid out as the embedded long-video model's (``shapes-long-mhla`` beside ``judges/long-video``) with
    an untrained block-causal MHLA stand-in (``helpers.long_video.write_long_video_model``): pass it as ``root``
    to ``embedded_model("long-video", "mhla", root)``, or ``root / "shapes-long-mhla"`` as the model."""
    from helpers.long_video import write_long_video_model

    root = tmp_path_factory.mktemp("long_video")
    write_long_video_model(root)
    return root


@pytest.fixture(scope="session")
def wan_family_dirs(tmp_path_factory):
    """Tiny pipelines of the Wan family (``helpers.wan_family.VARIANTS``) saved to disk, with MHLA weights for each.

    Keys: the variant (a stock Diffusers pipeline folder: ``WanImageToVideoPipeline`` for the I2V variants,
    ``WanPipeline`` for TI2V-5B and T2V-A14B) and ``"<variant>-mhla"``: MHLA weights written by
    ``pipe.save_mhla`` after ``pipe.convert_to_mhla(MHLAConfig(layout=(2, 2, 2)))`` -- a ``save_mhla`` folder, or
    for the A14B variants a folder with ``transformer/`` and ``transformer_2/``. Block 0's mixing is scaled
    (x1.5 in ``transformer``, x0.5 in ``transformer_2``), so weights that were not loaded, or loaded into the
    wrong transformer, change the output.
    """
    from helpers.wan_family import LAYOUT, VARIANTS, is_image_to_video, pipeline_class
    from mhla_diffusion import MHLAConfig
    from mhla_diffusion.models.tiny import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("wan_family")
    dirs = {}
    for variant in VARIANTS:
        stock = tiny_wan_pipeline(variant=variant)
        stock.save_pretrained(root / variant)
        pipe = pipeline_class(is_image_to_video(variant)).from_pipe(stock)  # the same modules and config
        pipe.convert_to_mhla(MHLAConfig(layout=LAYOUT))
        with torch.no_grad():
            for scale, transformer in zip((1.5, 0.5), pipe.transformer_components.values()):
                transformer.blocks[0].attn1.processor.mixing.mul_(scale)
        pipe.save_mhla(root / f"{variant}-mhla")
        dirs[variant], dirs[f"{variant}-mhla"] = root / variant, root / f"{variant}-mhla"
    return dirs


@pytest.fixture(scope="session")
def family_pipeline_dirs(tmp_path_factory):
    """Tiny stock pipelines of other families (``tiny_family_pipeline``: ``skyreels-v2``, ``hunyuan-video``,
    ``flux``) saved to disk, and beside each (``"<family>-mhla"``) MHLA weights for its transformer (``save_mhla`` after
    ``convert_to_mhla(MHLAConfig())``, block 0's mixing scaled x1.5 so that weights left unloaded change the
    output)."""
    from mhla_diffusion import MHLAConfig, convert_to_mhla, save_mhla
    from mhla_diffusion.models.conversion import get_mhla_conversion
    from mhla_diffusion.models.tiny_families import tiny_family_pipeline

    root = tmp_path_factory.mktemp("family_pipelines")
    dirs = {}
    for family in ("skyreels-v2", "hunyuan-video", "flux"):
        pipe = tiny_family_pipeline(family)
        pipe.save_pretrained(root / family)
        convert_to_mhla(pipe.transformer, MHLAConfig())
        first = get_mhla_conversion(pipe.transformer).layer_names[0]
        with torch.no_grad():
            pipe.transformer.get_submodule(first).processor.mixing.mul_(1.5)
        save_mhla(pipe.transformer, root / f"{family}-mhla")
        dirs[family], dirs[f"{family}-mhla"] = root / family, root / f"{family}-mhla"
    return dirs
