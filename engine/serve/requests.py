"""A ``POST /v1/videos`` request checked against what the server compiled.

Fields: OpenAI's (``prompt``, ``model``, ``seconds``, ``size``, ``input_reference``),
SGLang Diffusion's extensions (``negative_prompt``, ``num_frames``, ``num_inference_steps``,
``guidance_scale``, ``guidance_scale_2``, ``seed``, ``fps``) and OpenRouter's
``callback_url`` (``engine.serve.webhooks``).
Anything that would need a new compile (another shape, CFG switched on or off, a CFG scale
baked into the program, another step count under step caching or where the step's inputs
hold a per-step table, an fps the family's programs follow) is refused: nothing is
compiled on the request path. Every refusal is an ``ApiError`` whose message names the
field, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets

import pydantic

from engine.run.config import RunConfig

MAX_PROMPT_CHARS = 4000
MAX_STEPS = 1000
MAX_FPS = 120
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes up to 2**64 - 1
MAX_UPLOAD_BYTES = 20 * 1024 * 1024


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str = "invalid_value", kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def refuse(field: str, value, rule: str, status: int = 400, code: str = "invalid_value"):
    raise ApiError(status, f"{field}={value!r}: {rule}", field, code)


class VideoRequest(pydantic.BaseModel):
    """The fields' types; an unknown field is an error, not ignored."""

    model_config = pydantic.ConfigDict(extra="forbid")

    prompt: str
    model: str | None = None
    seconds: str | int | float | None = None
    size: str | None = None
    negative_prompt: str | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    seed: int | None = None
    fps: int | None = None
    callback_url: str | None = None


@dataclasses.dataclass(frozen=True)
class InputReference:
    """An image-to-video job's first frame as the job records it (``uploads.check``): its
    format ("PNG", "JPEG" or "WEBP"), pixel size, SHA-256 (hex), size in bytes, and the file
    name it was saved under beside the job store."""

    format: str
    width: int
    height: int
    sha256: str
    bytes: int
    file: str


@dataclasses.dataclass(frozen=True)
class VideoJob:
    """One job's settings, every field resolved and checked (``check``): the one form a job
    has from the HTTP body (after pydantic) to the ``RunConfig`` it runs as
    (``run_config``). The job store keeps its JSON form (``to_json`` / ``from_json``).

    Sizes in pixels; ``seconds`` is the video's length at the served fps as OpenAI's API
    gives it (a string, e.g. "4"); ``seed`` seeds the CPU ``torch.Generator`` of the initial
    latents; ``model`` is the served model's name; ``callback_url``: where the ended job's
    video object is POSTed (``engine.serve.webhooks``), or None.
    """

    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_frames: int
    seconds: str
    num_inference_steps: int
    guidance_scale: float
    guidance_scale_2: float | None
    seed: int
    fps: int
    model: str
    input_reference: InputReference | None = None
    callback_url: str | None = None

    @property
    def size(self) -> str:
        """OpenAI's ``size`` field: "WIDTHxHEIGHT"."""
        return f"{self.width}x{self.height}"

    def to_json(self) -> dict:
        """The stored form (JSON types only); ``size`` is written too, for readers of the
        store."""
        return dict(dataclasses.asdict(self), size=self.size)

    @classmethod
    def from_json(cls, data: dict) -> VideoJob:
        """The value ``to_json`` wrote (extra keys, such as ``size``, ignored)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        ref = values.get("input_reference")
        if ref is not None:
            values["input_reference"] = InputReference(**ref)
        return cls(**values)

    def run_config(self, bucket: RunConfig) -> RunConfig:
        """``bucket`` (the compiled shape's config) with this job's prompt, negative prompt,
        seed, steps, CFG scale and fps. Size and frames are the bucket's own: ``check``
        admits only served shapes."""
        return bucket.replace(
            prompt=self.prompt, negative_prompt=self.negative_prompt, seed=self.seed,
            num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
            fps=self.fps)


def parse(fields: dict) -> VideoRequest:
    """The request's fields as typed values.

    Raises:
        ApiError: 400 for an unknown field, a missing prompt or a value of the wrong type.
    """
    try:
        return VideoRequest.model_validate(fields)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "body"
        if err["type"] == "extra_forbidden":
            refuse(field, err["input"], "unknown field; expected one of "
                   + ", ".join(VideoRequest.model_fields) + ", input_reference")
        if err["type"] == "missing":
            refuse(field, None, "required")
        refuse(field, err.get("input"), err["msg"].split(",")[0].lower())


def check(req: VideoRequest, served, image: dict | None = None) -> VideoJob:
    """The job's settings (every field resolved; an unseeded job gets a seed here, so a
    restart regenerates the same video) from the request, its checked ``input_reference``
    (``engine.serve.uploads.check``'s dict, or None; the caller records the saved file with
    ``dataclasses.replace``) and the ``Served`` model.

    Raises:
        ApiError: 400 naming the field, the value and the rule.
    """
    _image(image, served)
    prompt = req.prompt
    if not prompt.strip():
        refuse("prompt", prompt, "must not be empty")
    for field in ("prompt", "negative_prompt"):
        text = getattr(req, field)
        if text is not None and len(text) > MAX_PROMPT_CHARS:
            refuse(field, text[:20] + "...", f"at most {MAX_PROMPT_CHARS} characters, got "
                   f"{len(text)}")
    if req.model is not None and req.model not in (served.model, served.model_id):
        refuse("model", req.model, f"this server serves {served.model!r}")
    width, height = _size(req.size, served)
    frames = _frames(req, served)
    steps = _number("num_inference_steps", req.num_inference_steps,
                    served.num_inference_steps, 1, MAX_STEPS)
    if served.fixed_steps and steps != served.num_inference_steps:
        refuse("num_inference_steps", steps, f"only {served.num_inference_steps} steps are "
               f"served ({served.steps_rule})")
    fps = _number("fps", req.fps, served.fps, 1, MAX_FPS)
    if served.fps_rule is not None and fps != served.fps:
        refuse("fps", fps, served.fps_rule)
    return VideoJob(prompt=prompt, negative_prompt=served.negative_prompt
                    if req.negative_prompt is None else req.negative_prompt,
                    width=width, height=height, num_frames=frames,
                    seconds=f"{(frames - 1) / served.fps:g}", num_inference_steps=steps,
                    guidance_scale=_guidance(req, served),
                    guidance_scale_2=_guidance_2(req, served),
                    seed=secrets.randbelow(2**31) if req.seed is None
                    else _number("seed", req.seed, 0, 0, MAX_SEED),
                    fps=fps, model=served.model)


def _image(image: dict | None, served) -> None:
    """An image-to-video model needs ``input_reference``; the others refuse it (TI2V-5B's
    image-to-video takes another pipeline and step program than the one served)."""
    if image is None and served.image_mode == "required":
        refuse("input_reference", None, f"required: {served.model!r} is an image-to-video "
               "model; send the first frame as a multipart file (PNG, JPEG or WebP)")
    if image is not None and served.image_mode != "required":
        refuse("input_reference", f"{image['format']} {image['width']}x{image['height']}",
               f"{served.model!r} is a text-to-video model" if served.image_mode == "none"
               else f"{served.model!r} is served as text-to-video only (its image-to-video "
               "runs another pipeline and step program)")


def _number(field: str, value, default, low, high):
    if value is None:
        return default
    if not low <= value <= high:
        refuse(field, value, f"must be in {low}..{high}")
    return value


def _size(size, served) -> tuple[int, int]:
    listed = ", ".join(f"{w}x{h}" for w, h in served.sizes)
    if size is None:
        return served.sizes[0]
    m = re.fullmatch(r"(\d+)x(\d+)", size.strip())
    if not m:
        refuse("size", size, f"expected WIDTHxHEIGHT; served sizes: {listed}")
    if (int(m[1]), int(m[2])) not in served.sizes:
        refuse("size", size, f"not a served size (each is compiled at start); served sizes: "
               f"{listed}")
    return int(m[1]), int(m[2])


def _frames(req: VideoRequest, served) -> int:
    """num_frames, or seconds at the model's fps rounded to the nearest frame_step*n + 1."""
    listed = ", ".join(f"{f} ({(f - 1) / served.fps:g} s)" for f in served.frames)
    from_seconds = None
    if req.seconds is not None:
        try:
            seconds = float(req.seconds)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds <= 0:
            refuse("seconds", req.seconds, "must be a number of seconds > 0")
        step = served.frame_step
        from_seconds = step * round(seconds * served.fps / step) + 1
    frames = req.num_frames if req.num_frames is not None else from_seconds
    if frames is None:
        return served.frames[0]
    if from_seconds is not None and frames != from_seconds:
        refuse("seconds", req.seconds, f"is {from_seconds} frames at {served.fps} fps, but "
               f"num_frames is {frames}")
    if frames not in served.frames:
        field, value = ("num_frames", frames) if req.num_frames is not None \
            else ("seconds", req.seconds)
        refuse(field, value, f"not a served length (each is compiled at start); served "
               f"frames: {listed}")
    return frames


def _guidance(req: VideoRequest, served) -> float:
    g = req.guidance_scale
    if g is None:
        return served.guidance_scale
    if not math.isfinite(g) or g < 0:
        refuse("guidance_scale", g, "must be a finite number >= 0")
    if not served.variable_guidance and g != served.guidance_scale:
        refuse("guidance_scale", g, f"this model's CFG scale is compiled in: only "
               f"{served.guidance_scale:g} is served")
    if (g > 1) != (served.guidance_scale > 1):
        refuse("guidance_scale", g, f"must be {'> 1' if served.guidance_scale > 1 else '<= 1'}"
               " as served (CFG on or off changes the compiled batch)")
    return g


def _guidance_2(req: VideoRequest, served) -> float | None:
    g = req.guidance_scale_2
    if g is None:
        return served.guidance_scale_2
    if served.guidance_scale_2 is None:
        refuse("guidance_scale_2", g, "only two-expert models take it")
    if g != served.guidance_scale_2:
        refuse("guidance_scale_2", g, f"fixed at start: only {served.guidance_scale_2:g} is "
               "served")
    return g
