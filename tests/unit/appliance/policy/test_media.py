"""The multimodal guard: text-only refusal, part counts, data URLs and the SSRF host list."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from appliance.core.errors import BadRequest
from appliance.policy import MediaPart, check_media, find_media_parts

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 24
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 24
GIF = b"GIF89a" + b"\x00" * 24
WEBP = b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 16
BMP = b"BM" + b"\x00" * 24
ALLOWED = ["images.example.com"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def image(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "look"}, *parts]
    return {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": content},
        ]
    }


def check(body: dict[str, Any], **limits: Any) -> None:
    options: dict[str, Any] = {
        "multimodal": True,
        "max_images": 4,
        "max_image_bytes": 1024,
        "allowed_hosts": ALLOWED,
    }
    check_media(find_media_parts(body), **{**options, **limits})


def refusal(body: dict[str, Any], **limits: Any) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        check(body, **limits)
    assert caught.value.status == 400
    return caught.value


# --- find_media_parts -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        (image("https://x/a.png"), MediaPart("messages[1].content[1]", "image", "https://x/a.png")),
        (
            {"type": "image_url", "image_url": "https://x/a.png"},
            MediaPart("messages[1].content[1]", "image", "https://x/a.png"),
        ),
        (
            {"type": "input_image", "image_url": "https://x/a.png"},
            MediaPart("messages[1].content[1]", "image", "https://x/a.png"),
        ),
        (
            {"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}},
            MediaPart("messages[1].content[1]", "audio", "https://x/a.wav"),
        ),
        (
            {"type": "video_url", "video_url": "https://x/a.mp4"},
            MediaPart("messages[1].content[1]", "video", "https://x/a.mp4"),
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            MediaPart("messages[1].content[1]", "audio", "UklGRg==", "base64"),
        ),
        (
            {"type": "file", "file": {"file_id": "f-1"}},
            MediaPart("messages[1].content[1]", "file", None),
        ),
        (
            {"type": "input_file", "file_id": "f-1"},
            MediaPart("messages[1].content[1]", "file", None),
        ),
        (
            {"type": "image_embeds", "image_embeds": "tensor"},
            MediaPart("messages[1].content[1]", "embeds", None),
        ),
    ],
    ids=[
        "image-object",
        "image-string",
        "input-image",
        "audio-url",
        "video-url",
        "input-audio",
        "file",
        "input-file",
        "image-embeds",
    ],
)
def test_find_media_parts_recognises_every_media_form(part: Any, expected: MediaPart) -> None:
    assert find_media_parts(chat(part)) == [expected]


def test_find_media_parts_names_each_part_by_its_position() -> None:
    body = chat(image("https://x/1.png"), {"type": "text", "text": "and"}, image("https://x/2.png"))
    assert [part.param for part in find_media_parts(body)] == [
        "messages[1].content[1]",
        "messages[1].content[3]",
    ]


def test_find_media_parts_ignores_text() -> None:
    body = chat({"type": "text", "text": "a"}, "plain")
    body["messages"].append({"role": "assistant", "content": None})
    assert find_media_parts(body) == []


def test_a_part_without_type_is_still_media_because_vllm_reads_it_by_key() -> None:
    assert find_media_parts(chat({"image_url": "http://evil/x.png"}))[0].kind == "image"


def test_a_text_part_smuggling_a_url_with_a_uuid_is_media() -> None:
    part = {"type": "text", "text": "hi", "uuid": "u1", "image_url": "http://10.0.0.1/x.png"}
    assert [p.source for p in find_media_parts(chat(part))] == ["http://10.0.0.1/x.png"]


def test_a_part_with_several_media_keys_yields_each_url_for_checking() -> None:
    part = {**image("https://images.example.com/ok.png"), "video_url": "http://10.0.0.1/"}
    sources = [p.source for p in find_media_parts(chat(part))]
    assert sources == ["https://images.example.com/ok.png", "http://10.0.0.1/"]
    assert refusal(chat(part)).code == "media_url_refused"


@pytest.mark.parametrize(
    "body",
    [{}, {"messages": "x"}, {"messages": [None, 3, {"content": 5}, {"content": [None, 7]}]}],
)
def test_find_media_parts_tolerates_any_body_shape(body: dict[str, Any]) -> None:
    assert find_media_parts(body) == []


# --- text-only models and counts --------------------------------------------------------


@pytest.mark.parametrize(
    "part",
    [
        image("https://images.example.com/a.png"),
        {"type": "input_audio", "input_audio": {"data": "AAAA"}},
        {"type": "audio_url", "audio_url": {"url": "https://images.example.com/a.wav"}},
        {"type": "video_url", "video_url": {"url": "https://images.example.com/a.mp4"}},
        {"type": "file", "file": {"file_data": "AAAA"}},
        {"type": "prompt_embeds", "data": "serialized-tensor"},
    ],
    ids=["image", "input-audio", "audio-url", "video", "file", "prompt-embeds"],
)
def test_a_text_only_model_refuses_any_media_part(part: Any) -> None:
    error = refusal(chat(part), multimodal=False)
    assert (error.param, error.code) == ("messages[1].content[1]", "multimodal_not_supported")


def test_a_text_only_model_accepts_text() -> None:
    check(chat({"type": "text", "text": "x"}), multimodal=False)


def test_more_parts_than_max_images_is_refused_at_the_first_extra_part() -> None:
    body = chat(*[image(data_url(PNG))] * 3)
    error = refusal(body, max_images=2)
    assert (error.param, error.code) == ("messages[1].content[3]", "too_many_media_parts")


def test_exactly_max_images_parts_pass() -> None:
    check(chat(*[image(data_url(PNG))] * 2), max_images=2)


def test_max_images_of_zero_refuses_every_part() -> None:
    assert refusal(chat(image(data_url(PNG))), max_images=0).code == "too_many_media_parts"


# --- data URLs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [PNG, JPEG, GIF, WEBP, BMP, b"GIF87a" + b"\x00" * 8],
    ids=["png", "jpeg", "gif89a", "webp", "bmp", "gif87a"],
)
def test_a_data_url_image_with_a_known_magic_number_passes(payload: bytes) -> None:
    check(chat(image(data_url(payload))))


@pytest.mark.parametrize(
    "payload",
    [b"<svg xmlns='x'/>", b"%PDF-1.7", b"RIFF\x00\x00\x00\x00WAVE", b""],
    ids=["svg", "pdf", "riff-wave", "empty"],
)
def test_a_data_url_image_without_a_known_magic_number_is_refused(payload: bytes) -> None:
    error = refusal(chat(image(data_url(payload))))
    assert (error.param, error.code) == ("messages[1].content[1]", "unknown_image_format")


def test_audio_and_video_data_urls_are_not_held_to_image_magic_numbers() -> None:
    check(chat({"type": "audio_url", "audio_url": {"url": data_url(b"RIFFxxxxWAVE", "audio/wav")}}))
    check(chat({"type": "video_url", "video_url": {"url": data_url(b"\x00\x00\x00 ftyp", "video/mp4")}}))


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png," + b64(PNG),
        "data:image/png;base64",
        "data:image/png;utf8,abc",
        "data:image/png;base64," + b64(PNG)[:-1],
        "data:image/png;base64," + b64(PNG).rstrip("="),
        "data:image/png;base64," + b64(PNG) + "AAAA=",
        "data:image/png;base64," + b64(PNG).replace("A", "-", 1),
        "data:image/png;base64," + b64(PNG) + "é",
        "data:image/png;base64,iVBORw0KGgr=",
    ],
    ids=[
        "not-base64",
        "no-comma",
        "other-encoding",
        "truncated",
        "no-padding",
        "after-padding",
        "urlsafe-alphabet",
        "non-ascii",
        "stray-bits",
    ],
)
def test_a_data_url_that_is_not_strict_base64_is_refused(url: str) -> None:
    assert refusal(chat(image(url))).code == "invalid_media_data"


def test_a_data_url_with_embedded_whitespace_is_refused() -> None:
    encoded = b64(PNG)
    url = f"data:image/png;base64,{encoded[:8]}\n{encoded[8:]}"
    assert refusal(chat(image(url))).code == "invalid_media_url"


def test_a_decoded_payload_of_exactly_max_bytes_passes() -> None:
    check(chat(image(data_url(PNG + b"\x00" * (1024 - len(PNG))))), max_image_bytes=1024)


def test_a_decoded_payload_over_max_bytes_is_refused() -> None:
    error = refusal(chat(image(data_url(PNG + b"\x00" * (1025 - len(PNG))))), max_image_bytes=1024)
    assert (error.param, error.code) == ("messages[1].content[1]", "media_too_large")
    assert "policy.max_image_bytes" in error.message


def test_a_huge_payload_is_refused_as_too_large_before_it_is_decoded() -> None:
    url = "data:image/png;base64," + "!" * 10_000  # not base64 at all: proves no decode happened
    assert refusal(chat(image(url)), max_image_bytes=1024).code == "media_too_large"


def test_input_audio_base64_is_decoded_strictly_and_bounded() -> None:
    def audio(data: str) -> dict[str, Any]:
        return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}

    check(chat(audio(b64(b"RIFF" + b"\x00" * 100))))
    assert refusal(chat(audio("not base64!"))).code == "invalid_media_data"
    assert refusal(chat(audio(b64(b"\x00" * 2000)))).code == "media_too_large"
    assert refusal(chat({"type": "input_audio", "input_audio": "AAAA"})).code == "invalid_media_part"


@pytest.mark.parametrize(
    "part",
    [image(None), image(5), {"type": "image_url", "image_url": {}}, {"type": "image_url"}],
    ids=["null-url", "number-url", "no-url-key", "no-image-url"],
)
def test_a_media_part_without_a_url_is_refused(part: Any) -> None:
    assert refusal(chat(part)).code == "invalid_media_part"


@pytest.mark.parametrize(
    "part",
    [
        {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0="}},
        {"type": "input_file", "file_url": "https://images.example.com/a.pdf"},
        {"type": "image_embeds", "image_embeds": "tensor"},
        {"type": "audio_embeds", "audio_embeds": "tensor"},
        {"type": "image_pil", "image_pil": "object"},
        {"type": "prompt_embeds", "data": "serialized-tensor"},
    ],
    ids=["file", "input-file", "image-embeds", "audio-embeds", "image-pil", "prompt-embeds"],
)
def test_parts_the_appliance_cannot_inspect_are_refused_on_a_multimodal_model(part: Any) -> None:
    error = refusal(chat(part))
    assert (error.param, error.code) == ("messages[1].content[1]", "unsupported_media_part")


# --- remote URLs: the SSRF guard --------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://images.example.com/cat.png",
        "http://images.example.com/cat.png",
        "https://IMAGES.Example.COM/cat.png",
        "HTTPS://images.example.com/cat.png",
        "https://images.example.com:8443/cat.png?size=large#frag",
    ],
    ids=["https", "http", "host-case", "scheme-case", "port-query-fragment"],
)
def test_a_url_on_an_allowed_host_passes(url: str) -> None:
    check(chat(image(url)))


def test_allowed_hosts_are_matched_case_insensitively_on_both_sides() -> None:
    check(chat(image("https://images.example.com/a.png")), allowed_hosts=["Images.EXAMPLE.com"])


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x.png",
        "http://localhost:8100/v1/models",
        "http://10.1.2.3/x.png",
        "http://192.168.1.1/",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/x.png",
        "http://2130706433/",
        "http://0x7f000001/",
        "http://0/",
        "http://evil.com/x.png",
        "http://images.example.com.evil.com/x.png",
        "http://evilimages.example.com/x.png",
        "http://images.example.com@evil.com/x.png",
        "http://images.example.com:80@127.0.0.1/",
        "http://user:pass@images.example.com/x.png",
        "http://evil.com\\@images.example.com/x.png",
        "http://evil.com\\.images.example.com/x.png",
        "http://images.example.com\t.evil.com/",
        "http://images.example.com%2f@evil.com/",
        " http://images.example.com/x.png",
        "http://images.exampIe.com/x.png",
        "http://images.example.com:99999/x.png",
        "http://images.example.com:port/x.png",
        "http://[::1/x.png",
        "http:///x.png",
        "//images.example.com/x.png",
        "images.example.com/x.png",
        "file:///etc/passwd",
        "file://images.example.com/etc/passwd",
        "ftp://images.example.com/x.png",
        "gopher://images.example.com:70/x",
        "javascript:alert(1)",
        "http://bücher.example/x.png",
    ],
)
def test_a_url_not_on_an_exactly_allowed_http_host_is_refused(url: str) -> None:
    error = refusal(chat(image(url)))
    assert error.param == "messages[1].content[1]"
    assert error.code in {"media_url_refused", "invalid_media_url"}


@pytest.mark.parametrize("url", ["http://127.0.0.1/x.png", "http://10.0.0.5/x.png", "http://localhost/x.png"])
def test_every_remote_url_is_refused_when_no_host_is_allowed(url: str) -> None:
    assert refusal(chat(image(url)), allowed_hosts=[]).code == "media_url_refused"


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://127.0.0.1:9000/x.png", "127.0.0.1"),
        ("http://localhost/x.png", "LOCALHOST"),
        ("http://[::1]/x.png", "[::1]"),
        ("http://[::1]/x.png", "::1"),
    ],
)
def test_a_lan_host_passes_only_when_allowed_exactly(url: str, allowed: str) -> None:
    check(chat(image(url)), allowed_hosts=[allowed])


def test_the_refusal_names_the_setting_to_change() -> None:
    assert "policy.allowed_media_hosts" in refusal(chat(image("http://evil.com/x"))).message


def test_every_part_is_checked_not_just_the_first() -> None:
    body = chat(image("https://images.example.com/ok.png"), image("http://10.0.0.1/x.png"))
    assert refusal(body).param == "messages[1].content[2]"
