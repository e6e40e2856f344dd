"""An mp4 file that stays playable while it grows: each group of frames is written as whole fragments.

A plain mp4 keeps its index (the ``moov`` box) at the end, so a writer that dies leaves a file nothing can read. A
fragmented mp4 puts an empty index first and then self-describing fragments (``moof`` + ``mdat``), so every fragment
that reached the file is readable. A muxer only writes a fragment once the next frame arrives, though, and a frame
in ffmpeg's pipe or in the encoder's look-ahead is lost with the process. So :class:`FragmentedMP4Writer` encodes
each :meth:`~FragmentedMP4Writer.append` (a streamed chunk) on its own, in this process, with PyAV: a fresh H.264
encoder and muxer write the group to memory, and the group's fragments are appended to the file before ``append``
returns. The first group also writes the header (``ftyp`` + ``moov``); every group's header is the same (same size,
rate and encoder settings), which is checked. Each later group's fragments are renumbered (``mfhd``) and moved in
time (``tfdt``) to follow the groups before. A reader then sees one video.

:meth:`~FragmentedMP4Writer.close` rewrites the finished file as an ordinary mp4 (index included, no re-encoding),
which every tool reads with its duration and frame count; a file whose writer was killed stays fragmented and
playable up to its last whole group.
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from typing import Iterator

import numpy as np

__all__ = ["FragmentedMP4Writer", "encode_fragments"]

#: ffmpeg's mp4 muxer options: an empty index up front, a fragment from each keyframe, offsets from each fragment.
_MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof"
#: H.264 settings: constant quality 18 (visually lossless), no B-frames (decode order is display order).
_X264 = {"crf": "18", "bf": "0"}


def _boxes(data: bytes | bytearray, start: int = 0, end: int | None = None) -> Iterator[tuple[str, int, int, int]]:
    """The boxes between ``start`` and ``end``: ``(type, offset, header size, size)`` each."""
    end = len(data) if end is None else end
    position = start
    while position + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, position)
        header = 8
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, position + 8)
            header = 16
        elif size == 0:
            size = end - position
        if size < header or position + size > end:
            raise ValueError(f"malformed mp4 box {kind!r} at byte {position}")
        yield kind.decode("latin-1"), position, header, size
        position += size


def _child(data: bytes | bytearray, path: tuple[str, ...], start: int = 0, end: int | None = None) -> tuple[int, int]:
    """``(offset of the payload, size of the payload)`` of the box at ``path`` (e.g. ``("moov", "trak", ...)``)."""
    for kind, position, header, size in _boxes(data, start, end):
        if kind == path[0]:
            if len(path) == 1:
                return position + header, size - header
            return _child(data, path[1:], position + header, position + size)
    raise ValueError(f"mp4 box {'/'.join(path)} not found")


def _timescale(data: bytes | bytearray) -> int:
    """Ticks per second of the (only) track, from its ``mdhd`` box."""
    payload, _ = _child(data, ("moov", "trak", "mdia", "mdhd"))
    version = data[payload]
    return struct.unpack_from(">I", data, payload + (20 if version == 1 else 12))[0]


def encode_fragments(frames: np.ndarray, fps: int) -> bytes:
    """``frames`` ``(F, H, W, 3)`` ``uint8`` as a whole fragmented mp4 (H.264, yuv420p), encoded in memory."""
    import av

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 of shape (F, H, W, 3), got {frames.dtype} {frames.shape}")
    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(f"an H.264 mp4 needs an even height and width, got {height}x{width}: use --format frames")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4", options={"movflags": _MOVFLAGS}) as container:
        stream = container.add_stream("libx264", rate=fps, options=dict(_X264))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


class FragmentedMP4Writer:
    """Appends groups of frames to an mp4 at ``path`` so that the file is a playable video after every
    :meth:`append` (see the module docstring). ``fps``: frames per second."""

    def __init__(self, path: str | os.PathLike, fps: int) -> None:
        self.path, self.fps = Path(path), int(fps)
        self.frames_written = 0
        self._file = None
        self._header: bytes | None = None
        self._sequence = 0  # fragments written so far (their mfhd numbers count on from here)
        self._ticks = 0  # the decode time, in the track's ticks, where the next group starts
        self._ticks_per_frame = 0

    def append(self, frames: np.ndarray) -> None:
        """Encode ``frames`` ``(F, H, W, 3)`` ``uint8`` and add them to the file; they are in it when this returns."""
        if len(frames) == 0:
            return
        data = bytearray(encode_fragments(frames, self.fps))
        boxes = list(_boxes(data))
        header = b"".join(bytes(data[p : p + s]) for kind, p, _, s in boxes if kind in ("ftyp", "moov"))
        if self._header is None:
            ticks, remainder = divmod(_timescale(data), self.fps)
            if remainder:
                raise ValueError(f"the mp4 track's timescale does not divide into {self.fps} frames per second")
            self._header, self._ticks_per_frame = header, ticks
            self._file = open(self.path, "wb", buffering=0)  # every write reaches the file at once
            self._file.write(header)
        elif header != self._header:
            raise ValueError(
                f"frames of {frames.shape[2]}x{frames.shape[1]} cannot join {self.path}: every group of a video "
                "must have the first group's size"
            )
        out = bytearray()
        for kind, position, header_size, size in boxes:
            if kind == "moof":
                self._shift_fragment(data, position + header_size, position + size)
                out += data[position : position + size]
            elif kind == "mdat":
                out += data[position : position + size]
        self._file.write(bytes(out))  # type: ignore[union-attr]
        self._ticks += len(frames) * self._ticks_per_frame
        self.frames_written += len(frames)

    def _shift_fragment(self, data: bytearray, start: int, end: int) -> None:
        """Renumber the ``moof`` between ``start`` and ``end`` and move its decode times after the groups before."""
        for kind, position, header, size in _boxes(data, start, end):
            if kind == "mfhd":
                self._sequence += 1
                struct.pack_into(">I", data, position + header + 4, self._sequence)
            elif kind == "traf":
                for inner, at, inner_header, _ in _boxes(data, position + header, position + size):
                    if inner == "tfdt":
                        payload = at + inner_header
                        if data[payload] == 1:
                            (time,) = struct.unpack_from(">Q", data, payload + 4)
                            struct.pack_into(">Q", data, payload + 4, time + self._ticks)
                        else:
                            (time,) = struct.unpack_from(">I", data, payload + 4)
                            struct.pack_into(">I", data, payload + 4, time + self._ticks)

    def close(self) -> None:
        """Close the file and rewrite it as an ordinary mp4 (index included, same frames, no re-encoding; the
        fragmented file stays if that fails)."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        _unfragment(self.path)


def _unfragment(path: Path) -> None:
    """Rewrite the fragmented mp4 at ``path`` as an ordinary one, packets copied; replaced atomically."""
    import av

    temporary = path.with_name(f".{path.name}.partial")
    try:
        with av.open(str(path)) as source, av.open(str(temporary), "w", format="mp4") as target:
            video = source.streams.video[0]
            stream = target.add_stream_from_template(video)
            for packet in source.demux(video):
                if packet.dts is None:  # the demuxer's end-of-stream marker
                    continue
                packet.stream = stream
                target.mux(packet)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
