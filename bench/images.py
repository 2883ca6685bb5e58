"""Images: `bouquet serve` on a CLIP over HTTP against sentence-transformers' CLIP in this process and the Infinity
server over HTTP, on the same images in one run; then where bouquet's time goes (decode, preprocess, encode).

The model is bench/image_models.py's: a random-weight CLIP at ViT-B/32's size (50 tokens an image) with
transformers' default CLIPImageProcessor, built once into --model-dir; the images are JPEG files of 300 x 200 to
1024 x 768 pixels (gradients with noise) generated here. Nothing comes from the internet. --tiny builds and measures a
2-layer CLIP of width 32 instead (in its own directory): a smoke run of the whole bench, whose figures mean nothing.

Throughput: --images images in requests of --per-request (base64 files in Infinity's `/embeddings_image` body,
answers in base64 floats), from --concurrency keep-alive clients; images/s end to end, the load generator included.
sentence-transformers gets the same files in batches of --per-request (`encode` on the PIL images, the JPEG decode
timed with it). Latency: one image a request, one request at a time, p50/p99; sentence-transformers one image an
`encode`. Every round runs bouquet, then sentence-transformers, then Infinity; medians of the rounds are printed,
and the ratios are from this one run. Vectors are compared by cosine: bouquet's against sentence-transformers' and
Infinity's (all of them the same transformers CLIPModel's features, L2-normalised).

Infinity (`.venv-peers` from `make peers`, which installs aiohttp: Infinity opens an HTTP session for every image
request, even for inline data, and refuses images without it) serves the same directory with transformers'
AutoModel and AutoProcessor (its TIMM class); with --no-infinity, or when its Python cannot import it, the bench
says so and measures the other two.

Where the time goes, measured after the servers have stopped, in this process on the gateway's and the engine's
own functions: base64 and JPEG decode (gateway/images.py), resize, crop and normalise (gateway/image_processing.py)
per image on one thread (the gateway runs images in parallel on its executor's threads), and the engine's forward
(all cores, in a process of its own as in a replica) per image at batches of --per-request and of one;
transformers' CLIPImageProcessor on the same images for comparison.

This 2-core VM is shared: another process on one core slows a two-thread forward of a few images several times
over (OpenMP's helpers sleep, and each of a forward's hundreds of parallel regions waits for the busy core), so the
load average before and after the rounds is printed beside the figures.

    .venv/bin/python bench/images.py [--images 96] [--per-request 8] [--concurrency 4] [--latency 40] [--rounds 3]
                                     [--tiny] [--model-dir DIR] [--infinity PYTHON | --no-infinity]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import image_models
import numpy as np
import peers
import torch
from PIL import Image

from bouquet.gateway.testing import Process, free_port, start_serve

NAME = "clip-vit-b32-random"
CACHE = Path.home() / ".cache" / "bouquet-bench"


@dataclass
class Server:
    """One HTTP server under test and what was measured of it."""

    name: str
    port: int
    route: str  # Infinity's /embeddings_image, under each server's prefix
    model: str
    seconds: list[float] = field(default_factory=list)  # all throughput requests, one per round
    latency: list[float] = field(default_factory=list)  # one-image requests, all rounds

    def post(self, connection: http.client.HTTPConnection, uris: list[str]) -> np.ndarray:
        body = json.dumps({"model": self.model, "input": uris, "encoding_format": "base64"})
        connection.request("POST", self.route, body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        data = reply.read()
        assert reply.status == 200, f"{self.name}: {reply.status} {data[:300]!r}"
        rows = json.loads(data)["data"]
        return np.stack([np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4") for row in rows])

    def vectors(self, uris: list[str]) -> np.ndarray:
        return self.post(http.client.HTTPConnection("127.0.0.1", self.port), uris)


def serve_images(server: Server, requests: list[list[str]], concurrency: int) -> float:
    """Wall seconds for all requests from `concurrency` clients, each on its own keep-alive connection."""
    pending, lock, done = iter(requests), threading.Lock(), []

    def run() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", server.port)
        while True:
            with lock:
                uris = next(pending, None)
            if uris is None:
                return
            server.post(connection, uris)
            done.append(1)

    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(done) != len(requests):  # a client thread failed (its traceback is above)
        raise RuntimeError(f"{server.name}: {len(requests) - len(done)} of {len(requests)} requests failed")
    return time.perf_counter() - start


def one_at_a_time(server: Server, uris: list[str]) -> list[float]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port)
    return [_timed(lambda uri=uri: server.post(connection, [uri])) for uri in uris]


def reference_encode(model, files: list[bytes]) -> np.ndarray:
    images = [Image.open(io.BytesIO(data)) for data in files]
    return model.encode(images, batch_size=len(images), normalize_embeddings=True)


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def percentiles(values: list[float]) -> str:
    p50, p99 = (float(np.percentile(values, q)) * 1e3 for q in (50, 99))
    return f"p50 {p50:7.2f} ms  p99 {p99:7.2f} ms"


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return peers.min_cosine(np.asarray(a, np.float64), np.asarray(b, np.float64))


def start_servers(args: argparse.Namespace, processes: list[Process]) -> list[Server]:
    port = free_port()
    processes.append(start_serve(
        port, "--model", str(args.model_dir), "--served-model-name", NAME, "--device", "cpu", "--dtype", "float32",
        "--max-payload-bytes", str(64 * 1024 * 1024),  # its 2 MiB default is a few photos' base64; Infinity has none
    ))  # fmt: skip
    processes[-1].wait_ready()
    servers = [Server("bouquet serve", port, "/embeddings_image", NAME)]
    if args.infinity:
        port = free_port()
        processes.append(peers.start_infinity(args.infinity, args.model_dir, port, "float32"))
        servers.append(Server("infinity", port, "/v1/embeddings_image", peers.SERVED_MODEL_NAME))
    return servers


def measure(servers: list[Server], model, files: list[bytes], args: argparse.Namespace) -> dict[str, list[float]]:
    """Rounds of throughput then rounds of latency, each round every server then sentence-transformers; returns
    sentence-transformers' throughput seconds (one per round) and latencies."""
    uris = [f"data:image/jpeg;base64,{base64.b64encode(data).decode()}" for data in files]
    step = args.per_request
    requests = [uris[i : i + step] for i in range(0, len(uris), step)]
    batches = [files[i : i + step] for i in range(0, len(files), step)]
    for server in servers:  # warm-up: connections, the replica's shapes, Infinity's first batches
        serve_images(server, requests[:4], args.concurrency)
        one_at_a_time(server, uris[:5])
    reference_encode(model, batches[0])
    reference: dict[str, list[float]] = {"seconds": [], "latency": []}
    for _ in range(args.rounds):
        for server in servers:
            server.seconds.append(serve_images(server, requests, args.concurrency))
        reference["seconds"].append(_timed(lambda: [reference_encode(model, batch) for batch in batches]))
    latency_uris, latency_files = uris[: args.latency], files[: args.latency]
    for _ in range(args.rounds):
        for server in servers:
            server.latency += one_at_a_time(server, latency_uris)
        reference["latency"] += [_timed(lambda d=data: reference_encode(model, [d])) for data in latency_files]
    return reference


def agreement(servers: list[Server], model, files: list[bytes], step: int) -> list[tuple[str, float]]:
    uris = [f"data:image/jpeg;base64,{base64.b64encode(data).decode()}" for data in files[:step]]
    ours = servers[0].vectors(uris)
    found = [("sentence-transformers", min_cosine(ours, reference_encode(model, files[:step])))]
    return found + [(server.name, min_cosine(ours, server.vectors(uris))) for server in servers[1:]]


def report_serving(
    servers: list[Server], reference: dict[str, list[float]], agreed: list[tuple[str, float]], args: argparse.Namespace
) -> None:
    tower, tokens = image_models.describe(args.model_dir)
    print(f"CLIP (random weights; image tower {tower}: {tokens} tokens an image), float32, "
          f"{torch.get_num_threads()} threads, "
          f"{args.rounds} rounds (medians); load average {args.load[0]:.1f} before, {args.load[1]:.1f} after "
          "(above the cores' count, other processes shared them)")  # fmt: skip
    for name, cosine in agreed:
        print(f"  {name} image embeddings against bouquet's: min cosine {cosine:.7f}")
    if not args.infinity:
        print(f"  infinity: not measured ({args.infinity_skipped})")
    print(f"throughput: {args.images} JPEG images, {args.per_request} a request, {args.concurrency} concurrent")
    rates = {server.name: args.images / statistics.median(server.seconds) for server in servers}
    rates["sentence-transformers"] = args.images / statistics.median(reference["seconds"])
    for name, rate in rates.items():
        rounds = ", ".join(f"{args.images / s:.1f}" for s in next((x.seconds for x in servers if x.name == name),
                                                                   reference["seconds"]))  # fmt: skip
        print(f"  {name:24} {rate:8.1f} images/s   (rounds: {rounds})")
    for name, rate in list(rates.items())[1:]:
        print(f"  {'ratio':24} {rates['bouquet serve'] / rate:8.2f}x {name}")
    print(f"latency: one image a request, one at a time, {args.latency} x {args.rounds}")
    latencies = {server.name: server.latency for server in servers}
    latencies["sentence-transformers"] = reference["latency"]
    for name, values in latencies.items():
        print(f"  {name:24} {percentiles(values)}")
    ours = statistics.median(latencies["bouquet serve"])
    for name, values in list(latencies.items())[1:]:
        print(f"  p50 ratio ({name} / bouquet serve) {statistics.median(values) / ours:.2f}x")


def breakdown(args: argparse.Namespace, files: list[bytes]) -> None:
    """Per image, in this process: decode and preprocess as the gateway runs them, encode as the replica does."""
    from transformers import CLIPImageProcessor

    from bouquet.gateway.image_processing import parse_processor_config
    from bouquet.gateway.images import ImageLimits, image_file, open_image

    processing = parse_processor_config((args.model_dir / "preprocessor_config.json").read_text())
    limits = ImageLimits(max_bytes=8 * 1024 * 1024, max_pixels=64 * 1024 * 1024)
    sources = [base64.b64encode(data).decode() for data in files]
    decode, preprocess, images, pixels = [], [], [], []
    for index, source in enumerate(sources):
        start = time.perf_counter()
        images.append(open_image(image_file(source, f"input[{index}]", limits.max_bytes), "input", limits)[0])
        decode.append(time.perf_counter() - start)
        start = time.perf_counter()
        pixels.append(processing(images[-1]))
        preprocess.append(time.perf_counter() - start)
    reference = CLIPImageProcessor.from_pretrained(args.model_dir)
    transformers_ms = [_timed(lambda im=im: reference(images=[im], return_tensors="np")) for im in images]
    with tempfile.TemporaryDirectory() as folder:  # the engine in a process of its own, as a replica runs it
        np.save(Path(folder) / "pixels.npy", np.stack(pixels))
        command = [sys.executable, __file__, "--encode-only", folder, "--per-request", str(args.per_request),
                   "--model-dir", str(args.model_dir)]  # fmt: skip
        subprocess.run(command, check=True)
        encode = {
            int(size): seconds for size, seconds in json.loads((Path(folder) / "encode.json").read_text()).items()
        }
    parts = {"decode (base64 + JPEG)": statistics.median(decode), "preprocess": statistics.median(preprocess),
             f"encode (batch {args.per_request})": encode[args.per_request]}  # fmt: skip
    total, tokens = sum(parts.values()), image_models.describe(args.model_dir)[1]
    print(f"where bouquet's time goes, per image (median of {len(files)} images; decode and preprocess on one thread; "
          f"encode one step at a time: {args.per_request} images ({tokens * args.per_request} tokens) a step, on one "
          "engine worker's thread when over --cpu-lone-step-tokens (256), where serve runs "
          f"two workers' steps at once; a lone image's {tokens} tokens on every thread):")  # fmt: skip
    for name, seconds in parts.items():
        print(f"  {name:28} {seconds * 1e3:7.2f} ms   {seconds / total:5.1%}")
    print(f"  {'encode (batch 1)':28} {encode[1] * 1e3:7.2f} ms")
    print(f"  {'transformers preprocess':28} {statistics.median(transformers_ms) * 1e3:7.2f} ms   "
          f"(CLIPImageProcessor{'Pil' if 'Pil' in type(reference).__name__ else ''}, the same images)")  # fmt: skip


def encode_only(folder: Path, model_dir: Path, per_request: int) -> None:
    """The engine's forward per image at batches of `per_request` and of one, on the pixels in `folder`; in a fresh
    process, because OpenMP teams that sentence-transformers' forward left in the bench's process slow the engine's
    (bouquet.engine.cpu_threads)."""
    from bouquet.batch import Batch
    from bouquet.config import EngineConfig
    from bouquet.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype="float32"))
    stacked, tokens, encode = np.load(folder / "pixels.npy"), image_models.describe(model_dir)[1], {}
    for size in (per_request, 1):
        batches = [stacked[i : i + size] for i in range(0, min(len(stacked), 8 * size), size)]
        engine.embed(Batch.pack_images(batches[0], tokens))  # warm-up
        seconds = [_timed(lambda b=b: engine.embed(Batch.pack_images(b, tokens))) / len(b) for b in batches]
        encode[size] = statistics.median(seconds)
    engine.close()
    (folder / "encode.json").write_text(json.dumps(encode))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--per-request", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--latency", type=int, default=40, help="one-image requests a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer CLIP of width 32: a smoke run")
    parser.add_argument("--model-dir", type=Path, help=f"where the CLIP is built (default: {CACHE}/{NAME}, or -tiny)")
    parser.add_argument("--infinity", type=Path, default=peers.PEERS_PYTHON, metavar="PYTHON")
    parser.add_argument("--no-infinity", action="store_true")
    parser.add_argument("--encode-only", type=Path, help=argparse.SUPPRESS)  # breakdown()'s child process
    args = parser.parse_args()
    args.model_dir = args.model_dir or CACHE / (f"{NAME}-tiny" if args.tiny else NAME)
    if args.encode_only:
        return encode_only(args.encode_only, args.model_dir, args.per_request)
    args.infinity_skipped = "--no-infinity" if args.no_infinity else ""
    if not args.no_infinity:
        try:
            peers.require(args.infinity, "infinity_emb")
            peers.require(args.infinity, "aiohttp")
        except SystemExit as error:
            args.infinity_skipped = str(error)
    if args.infinity_skipped:
        args.infinity = None

    from sentence_transformers import SentenceTransformer

    image_models.build_clip(args.model_dir, tiny=args.tiny)
    files = image_models.jpeg_files(args.images)
    model = SentenceTransformer(str(args.model_dir), device="cpu")
    processes: list[Process] = []
    try:
        servers = start_servers(args, processes)
        agreed = agreement(servers, model, files, args.per_request)
        args.load = [os.getloadavg()[0]]
        reference = measure(servers, model, files, args)
        args.load.append(os.getloadavg()[0])
    finally:
        for process in processes:
            process.stop()
    report_serving(servers, reference, agreed, args)
    breakdown(args, files[: min(len(files), 48)])


if __name__ == "__main__":
    main()
