"""Guard multimodal content parts: text-only refusal, counts, data URLs and the SSRF host list."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn
from urllib.parse import urlsplit

from appliance.core.errors import BadRequest

MediaKind = Literal["image", "audio", "video", "file", "embeds"]
Encoding = Literal["url", "base64"]

# Part type -> (kind, the key holding its URL or data). "embeds" are inputs the appliance
# cannot inspect (tensors, PIL objects); "file" parts are not something vLLM can read.
_BY_TYPE: dict[str, tuple[MediaKind, str | None]] = {
    "image_url": ("image", "image_url"),
    "input_image": ("image", "image_url"),
    "audio_url": ("audio", "audio_url"),
    "input_audio": ("audio", "input_audio"),
    "video_url": ("video", "video_url"),
    "file": ("file", "file"),
    "input_file": ("file", None),
    "image_embeds": ("embeds", "image_embeds"),
    "audio_embeds": ("embeds", "audio_embeds"),
    "video_embeds": ("embeds", "video_embeds"),
    "image_pil": ("embeds", "image_pil"),
    "prompt_embeds": ("embeds", "data"),  # a serialized tensor spliced into the prompt
}
# vLLM also reads a part by its keys when "type" is missing or a "uuid" is given, so
# {"type": "text", "uuid": ..., "image_url": ...} is an image to the engine. Every media key
# present is therefore a media item of its own, whatever the type says.
_BY_KEY: dict[str, MediaKind] = {
    "image_url": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "video_url": "video",
    "image_embeds": "embeds",
    "audio_embeds": "embeds",
    "video_embeds": "embeds",
    "image_pil": "embeds",
    "file": "file",
    "file_data": "file",
    "file_url": "file",
}
_URL_KEYS = frozenset({"image_url", "audio_url", "video_url"})
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM")
_REMOTE_SCHEMES = frozenset({"http", "https"})


@dataclass(frozen=True)
class MediaPart:
    """One media part of a chat request: where it is, what it is, and its URL or base64 data."""

    param: str  # e.g. "messages[0].content[1]"
    kind: MediaKind
    source: str | None  # a URL (data: or remote) or raw base64; None when absent or unreadable
    encoding: Encoding = "url"


def find_media_parts(body: Mapping[str, Any]) -> list[MediaPart]:
    """Every media item in the chat messages, in order; tolerant of any body shape.

    A content part normally holds one item; one that carries several media keys yields one
    item per key, all with the part's param, so each URL the engine might read is checked.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    found: list[MediaPart] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict):
                found.extend(_media_items(part, f"messages[{i}].content[{j}]"))
    return found


def find_batch_media_parts(body: Mapping[str, Any]) -> list[MediaPart]:
    """Every media item of every conversation of a chat batch (messages[i][j].content[k])."""
    conversations = body.get("messages")
    if not isinstance(conversations, list):
        return []
    found: list[MediaPart] = []
    for i, conversation in enumerate(conversations):
        for part in find_media_parts({"messages": conversation}):
            found.append(MediaPart(f"messages[{i}]{part.param.removeprefix('messages')}",
                                   part.kind, part.source, part.encoding))
    return found


def find_responses_media(body: Mapping[str, Any]) -> list[MediaPart]:
    """Every media item of a Responses input: message content parts (input_image, input_file,
    input_audio) and the parts a function_call_output may carry; in `input` and in vLLM's
    `previous_input_messages` (a conversation given whole), which the engine renders alike."""
    found: list[MediaPart] = []
    for field in ("input", "previous_input_messages"):
        items = body.get(field)
        for i, item in enumerate(items if isinstance(items, list) else []):
            if not isinstance(item, dict):
                continue
            for key in ("content", "output"):
                parts = item.get(key)
                for j, part in enumerate(parts if isinstance(parts, list) else []):
                    if isinstance(part, dict):
                        found.extend(_media_items(part, f"{field}[{i}].{key}[{j}]"))
    return found


def find_anthropic_media(body: Mapping[str, Any]) -> list[MediaPart]:
    """Every image and document block of an Anthropic request, tool results' included."""
    found: list[MediaPart] = []
    system = body.get("system")
    if isinstance(system, list):
        found.extend(_anthropic_blocks(system, "system"))
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found.extend(_anthropic_blocks(content, f"messages[{i}].content"))
    return found


def _anthropic_blocks(blocks: list[Any], param: str) -> list[MediaPart]:
    found: list[MediaPart] = []
    for k, block in enumerate(blocks):
        if not isinstance(block, dict):
            continue
        where, kind = f"{param}[{k}]", block.get("type")
        if kind == "image":
            found.append(MediaPart(where, "image", _anthropic_source(block.get("source"))))
        elif kind == "document":
            found.append(MediaPart(where, "file", None))
        elif kind == "tool_result" and isinstance(block.get("content"), list):
            found.extend(_anthropic_blocks(block["content"], f"{where}.content"))
    return found


def _anthropic_source(source: Any) -> str | None:
    """The URL the engine would read for an image source: a URL, or base64 as a data URL."""
    if not isinstance(source, dict):
        return None
    if source.get("type") == "url":
        url = source.get("url")
        return url if isinstance(url, str) else None
    data, media_type = source.get("data"), source.get("media_type", "image/jpeg")
    if source.get("type", "base64") != "base64" or not isinstance(data, str) \
            or not isinstance(media_type, str):
        return None
    return f"data:{media_type};base64,{data}"


def check_media(
    parts: Sequence[MediaPart],
    *,
    multimodal: bool,
    max_images: int,
    max_image_bytes: int,
    allowed_hosts: Iterable[str],
) -> None:
    """BadRequest for a media part this model or this appliance's limits do not allow.

    max_images counts every media part (images, audio, video); max_image_bytes bounds each
    decoded data payload. Remote URLs pass only when their host is exactly allow-listed.
    """
    if not parts:
        return
    if not multimodal:
        first = parts[0]
        raise BadRequest(
            f"This model accepts text only; '{first.param}' is {_article(first.kind)} part.",
            param=first.param,
            code="multimodal_not_supported",
        )
    if len(parts) > max_images:
        raise BadRequest(
            f"At most {max_images} media parts are allowed per request; got {len(parts)}.",
            param=parts[max_images].param,
            code="too_many_media_parts",
        )
    hosts = {_normalize_host(host) for host in allowed_hosts}
    for part in parts:
        _check_part(part, max_image_bytes, hosts)


def _media_items(part: Mapping[str, Any], param: str) -> list[MediaPart]:
    readers: dict[str | None, MediaKind] = {}
    part_type = part.get("type")
    if isinstance(part_type, str) and part_type in _BY_TYPE:
        kind, key = _BY_TYPE[part_type]
        readers[key] = kind
    for key, kind in _BY_KEY.items():
        if part.get(key) is not None:
            readers.setdefault(key, kind)
    return [_read(part, param, kind, key) for key, kind in readers.items()]


def _read(part: Mapping[str, Any], param: str, kind: MediaKind, key: str | None) -> MediaPart:
    value = part.get(key) if key is not None else None
    if key == "input_audio":
        data = value.get("data") if isinstance(value, dict) else None
        return MediaPart(param, kind, data if isinstance(data, str) else None, "base64")
    if key not in _URL_KEYS:
        return MediaPart(param, kind, None)
    url = value.get("url") if isinstance(value, dict) else value
    return MediaPart(param, kind, url if isinstance(url, str) else None)


def _check_part(part: MediaPart, max_bytes: int, hosts: set[str]) -> None:
    if part.kind in ("file", "embeds"):
        what = "file" if part.kind == "file" else "pre-computed (embedding or PIL)"
        _refuse(
            part,
            f"'{part.param}': {what} parts are not accepted; send an image, audio "
            "or video URL or data URL.",
            "unsupported_media_part",
        )
    if part.source is None:
        _refuse(part, f"'{part.param}' has no URL or data.", "invalid_media_part")
    if part.encoding == "base64":
        _decode(part, part.source, max_bytes)
        return
    if _has_unsafe_chars(part.source):
        _refuse(
            part,
            f"'{part.param}' has a URL with spaces, control characters or backslashes.",
            "invalid_media_url",
        )
    scheme = part.source.split(":", 1)[0].lower() if ":" in part.source else ""
    if scheme == "data":
        _check_data_url(part, part.source, max_bytes)
    elif scheme in _REMOTE_SCHEMES:
        _check_remote_url(part, part.source, hosts)
    else:
        _refuse(
            part, f"'{part.param}': only http(s) and data URLs are accepted.", "media_url_refused"
        )


def _check_data_url(part: MediaPart, url: str, max_bytes: int) -> None:
    header, comma, data = url[len("data:") :].partition(",")
    if not comma or not header.lower().endswith(";base64"):
        _refuse(
            part,
            f"'{part.param}': a data URL must be base64 (data:<type>;base64,<data>).",
            "invalid_media_data",
        )
    decoded = _decode(part, data, max_bytes)
    if part.kind == "image" and not _is_known_image(decoded):
        _refuse(
            part,
            f"'{part.param}' is not a PNG, JPEG, GIF, WEBP or BMP image.",
            "unknown_image_format",
        )


def _decode(part: MediaPart, data: str, max_bytes: int) -> bytes:
    """Strict base64 with the size bounded before decoding, so a huge payload costs nothing."""
    if len(data) > 4 * ((max_bytes + 2) // 3):
        _too_large(part, max_bytes)
    try:
        decoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        decoded = None
    # Re-encoding must give the input back: refuses data after padding and stray bits.
    if decoded is None or base64.b64encode(decoded) != data.encode("ascii"):
        _refuse(part, f"'{part.param}' is not valid base64.", "invalid_media_data")
    if len(decoded) > max_bytes:
        _too_large(part, max_bytes)
    return decoded


def _check_remote_url(part: MediaPart, url: str, hosts: set[str]) -> None:
    try:
        split = urlsplit(url)
        split.port  # noqa: B018 - parses the port; a bad one raises ValueError
    except ValueError:
        _refuse(part, f"'{part.param}' is not a valid URL.", "invalid_media_url")
    # Credentials in the authority are refused outright: parsers disagree on where the
    # host starts (http://allowed@evil, http://evil\@allowed), and that is the SSRF trick.
    if "@" in split.netloc:
        _refuse(
            part, f"'{part.param}': URLs with credentials are not accepted.", "media_url_refused"
        )
    host = split.hostname or ""
    if not host.isascii() or _normalize_host(host) not in hosts:
        _refuse(
            part,
            f"'{part.param}': media host {host!r} is not allowed "
            "(setting policy.allowed_media_hosts).",
            "media_url_refused",
        )


def _is_known_image(data: bytes) -> bool:
    if data.startswith(_IMAGE_MAGIC):
        return True
    return data[:4] == b"RIFF" and data[8:12] == b"WEBP"


def _has_unsafe_chars(url: str) -> bool:
    return any(ord(char) <= 0x20 or char in "\x7f\\" for char in url)


def _normalize_host(host: str) -> str:
    return host.strip().lower().removeprefix("[").removesuffix("]")


def _article(kind: MediaKind) -> str:
    return {
        "image": "an image",
        "audio": "an audio",
        "video": "a video",
        "file": "a file",
        "embeds": "a pre-computed media",
    }[kind]


def _too_large(part: MediaPart, max_bytes: int) -> NoReturn:
    _refuse(
        part,
        f"'{part.param}' is larger than {max_bytes} bytes once decoded "
        "(setting policy.max_image_bytes).",
        "media_too_large",
    )


def _refuse(part: MediaPart, message: str, code: str) -> NoReturn:
    raise BadRequest(message, param=part.param, code=code)
