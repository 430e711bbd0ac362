"""Fetch image and video bytes from a data: or http(s) URL, with the limits of MediaLimits
(pipeline/media/limits.py; decoding them: pipeline/media/decode.py).

The raw bytes are what the cache key hashes, so they are needed before, and often
instead of, decoding: the ingress fetches, Preprocess decodes the misses.

Every failure is an IrisError 400 with a code the client can act on (video_* for videos):
  invalid_image_url       scheme not supported (file://, ftp://, bare paths) or malformed data: URL
  image_fetch_failed      address not allowed (SSRF guard), error status, connection error,
                          timeout, too many redirects; the reason is generic and never
                          repeats the remote server's status line or body
  image_too_large         over max_image_bytes, or over max_image_pixels (decompression bomb);
                          videos: over max_video_bytes, max_video_frame_pixels,
                          max_video_frames or max_video_duration_s
  unsupported_image_format  a real image, but in a format not allowed here
  invalid_image           bad base64, not an image, truncated or corrupt

SSRF guard: http(s) fetches connect only to public addresses, plus the hosts
and networks named in allowed_fetch_hosts / allowed_fetch_cidrs; every
connection, redirects included, is checked after DNS resolution
(pipeline/media/fetch_client.py, pipeline/media/address_policy.py).
"""

from __future__ import annotations

import asyncio
import binascii
import logging

import httpx
import pybase64  # vLLM's own: many times the standard library's speed on a validated decode

from pipeline.errors import IrisError, bad_request
from pipeline.media.fetch_client import FetchRefused, GuardedClient
from pipeline.media.limits import MediaLimits, too_large_bytes

logger = logging.getLogger(__name__)


def fetch_client(limits: MediaLimits) -> GuardedClient:
    """A pooled http client for load_media_bytes that enforces the limits' SSRF policy."""
    return GuardedClient(limits.fetch_policy(), limits.fetch_timeout_s)


def _short(url: str, n: int = 100) -> str:
    # URLs go into error messages; a data: URL can be megabytes long.
    return url if len(url) <= n else url[:n] + "..."


# ---------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------


async def load_media_bytes(
    url: str,
    limits: MediaLimits,
    client: httpx.AsyncClient | None = None,
    *,
    param: str | None = None,
    modality: str = "image",
) -> bytes:
    """Return the raw bytes behind a data: or http(s) URL of an image or a video.

    `param` names the request field the URL came from, for error messages.
    """
    m = modality
    if not isinstance(url, str) or not url:
        raise bad_request(f"{m} URL must be a non-empty string", param, f"invalid_{m}_url")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _load_data_url(url, limits, param, m)
    if scheme in ("http", "https"):
        if not limits.allow_http:
            raise bad_request(
                f"fetching {m}s over http(s) is disabled on this server; send the {m} inline as a base64 data: URL",
                param,
                f"invalid_{m}_url",
            )
        return await _fetch_http(url, limits, client, param, m)
    raise bad_request(
        f"unsupported {m} URL {_short(url)!r}: only data: (base64) and http(s) URLs are accepted",
        param,
        f"invalid_{m}_url",
    )


def _load_data_url(url: str, limits: MediaLimits, param: str | None, m: str = "image") -> bytes:
    # data:[<media type>][;<param>...];base64,<payload>
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise bad_request("malformed data: URL: no ',' before the payload", param, f"invalid_{m}_url")
    fields = [f.strip() for f in header.split(";")]
    media_type, options = fields[0].lower(), [f.lower() for f in fields[1:]]
    if "base64" not in options:
        raise bad_request(
            f"only base64 data: URLs are supported (data:{m}/<type>;base64,...)",
            param,
            f"invalid_{m}_url",
        )
    if media_type and not (media_type.startswith(f"{m}/") or media_type == "application/octet-stream"):
        raise bad_request(f"data: URL has media type {media_type!r}; expected {m}/*", param, f"invalid_{m}_url")
    # Reject by the encoded length before spending memory on decoding.
    if len(payload) // 4 * 3 > limits.max_bytes(m) + 2:
        raise too_large_bytes(f"more than {limits.max_bytes(m)}", limits, param, m)
    try:
        data = pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"data: URL payload is not valid base64: {e}", param, f"invalid_{m}") from None
    if not data:
        raise bad_request("data: URL payload is empty", param, f"invalid_{m}")
    if len(data) > limits.max_bytes(m):
        raise too_large_bytes(str(len(data)), limits, param, m)
    return data


def _fetch_failed(url: str, reason: str, param: str | None, m: str = "image") -> IrisError:
    # `reason` is always one of our own fixed phrases: the remote server's status
    # line, body and error text are never repeated to the client (they could be an
    # internal service's answer), only logged.
    return bad_request(f"could not fetch {m} {_short(url)!r}: {reason}", param, f"{m}_fetch_failed")


async def _fetch_http(
    url: str, limits: MediaLimits, client: httpx.AsyncClient | None, param: str | None, m: str = "image"
) -> bytes:
    # Only a client that enforces this very policy will do; any other (None, a
    # plain httpx client, another policy) is replaced for this call.
    own_client = not (isinstance(client, GuardedClient) and client.policy == limits.fetch_policy())
    if own_client:
        client = fetch_client(limits)
    try:
        # One deadline for the whole fetch, DNS and redirects included: httpx
        # timeouts are per operation, so a server trickling bytes could otherwise
        # hold us forever.
        async with asyncio.timeout(limits.fetch_timeout_s):
            return await _fetch_following_redirects(client, url, limits, param, m)
    except TimeoutError:
        raise _fetch_failed(url, f"timed out after {limits.fetch_timeout_s:g} s", param, m) from None
    except FetchRefused:
        raise _fetch_failed(
            url, f"the address is not allowed: this server fetches {m}s from public addresses only", param, m
        ) from None
    except httpx.TimeoutException:
        raise _fetch_failed(url, "timed out", param, m) from None
    except httpx.ConnectError as e:
        logger.info("%s fetch: could not connect for %s: %s", m, _short(url), e)
        raise _fetch_failed(url, "could not connect to the server", param, m) from None
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        logger.info("%s fetch failed for %s: %s: %s", m, _short(url), type(e).__name__, e)
        raise _fetch_failed(url, "the request failed", param, m) from None
    finally:
        if own_client:
            await client.aclose()


async def _fetch_following_redirects(
    client: httpx.AsyncClient, url: str, limits: MediaLimits, param: str | None, m: str
) -> bytes:
    # Redirects by hand: the limit is ours rather than the (maybe shared)
    # client's, and every hop must stay http(s). Each hop's connection is
    # checked by the client's SSRF guard.
    current = url
    for _ in range(limits.max_redirects + 1):
        async with client.stream("GET", current, follow_redirects=False) as resp:
            if resp.is_redirect:
                target = resp.url.join(resp.headers["location"])
                if target.scheme not in ("http", "https"):
                    raise _fetch_failed(url, "redirected to a URL that is not http(s)", param, m)
                current = str(target)
                continue
            if not resp.is_success:
                logger.info("%s fetch: %s answered HTTP %d", m, _short(current), resp.status_code)
                raise _fetch_failed(url, f"the server did not return the {m}", param, m)
            # An honest Content-Length over the limit fails before any body is read.
            declared = resp.headers.get("content-length")
            if declared and declared.isdigit() and "content-encoding" not in resp.headers:
                if int(declared) > limits.max_bytes(m):
                    raise too_large_bytes(declared, limits, param, m)
            buf = bytearray()
            # aiter_bytes yields decoded bytes, so a gzip bomb is counted as it inflates.
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) > limits.max_bytes(m):
                    raise too_large_bytes(f"more than {limits.max_bytes(m)}", limits, param, m)
            if not buf:
                raise _fetch_failed(url, "the response body is empty", param, m)
            return bytes(buf)
    raise _fetch_failed(url, f"more than {limits.max_redirects} redirects", param, m)
