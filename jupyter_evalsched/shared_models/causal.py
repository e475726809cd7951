"""A causal language model served to the OpenAI-compatible routes, inside its model host.

``CausalLM`` holds a transformers causal LM and its tokenizer. The host calls
``openai_batch(requests)`` with every queued request of every caller at once; each request is one
prompt (a dict made by ``openai_requests``), each answer a dict of token-level results (or
``{"error": {"message", "param"}}`` for that request alone), formatted into OpenAI's shapes by
the server.

Scoring (the prompt's own log-probabilities, what loglikelihood evaluations read) runs all the
batch's prompts through one right-padded forward pass with an attention mask. Generation runs
the batch's generating requests together, one token per step for all of them (left-padded, with
a KV cache), each with its own length, stop strings, temperature, top-p and seed; a request that
is done stops being computed, and is answered at once.

Streaming: a request with ``"stream": true`` also has its text sent as it is generated, through
``on_delta``: first ``{"prompt_text", "prompt_tokens", "logprobs"}`` (the prompt's entries, when
echoed with logprobs), then ``{"pieces", "logprobs"}`` for each run of tokens whose text is
final (text that could still be cut by a stop string, or half a character, is held back), so
the pieces sent add up to the answer's. ``cancelled(i)`` is asked at every step: a request
whose caller went away stops generating (``finish_reason: "cancelled"``) and its row leaves
the batch, while the others go on.

Plain calls (``ctx.model(name)(["text"])``, the host's ``call`` op) greedily complete each string.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable
from typing import Any

from .detokenize import REPLACEMENT, IncrementalText, offsets
from .stops import StopStrings

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
MAX_TOP_LOGPROBS = 20
# A temperature below this is read as 0 (greedy): tempered by it, a token whose logit is 0.001
# below the largest has a probability under e^-100 already, and a tinier divisor can be no
# number at all in float32 (5e-324 is 0 there).
GREEDY_BELOW = 1e-5
# Echo scoring's memory: the logits of one forward pass of prompts (a pass holds at least one
# prompt, whatever its length), and the float32 log-probabilities computed at once.
SCORE_LOGITS_BYTES = 1 << 30
SCORE_CHUNK_BYTES = 64 << 20


class RequestError(ValueError):
    """A request this model cannot serve as given (too long a prompt): a 400 for that request."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class CausalLM:
    """Serves one causal LM: ``openai_batch`` for the API, ``__call__`` for plain calls."""

    serves_openai = True

    def __init__(self, model: Any, tokenizer: Any, device: str):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        config = model.config
        self.context = int(
            getattr(config, "n_positions", None)
            or getattr(config, "max_position_embeddings", None)
            or min(int(getattr(tokenizer, "model_max_length", 2048)), 1 << 20)
        )
        eos = tokenizer.eos_token_id
        self.eos_id: int | None = int(eos) if isinstance(eos, int) else None
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eos_id
        self.bos_id: int | None = int(bos) if bos is not None else None
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self._texts: dict[int, str] = {}
        # Tokens served so far (every answered request, API or plain call): the host's figures.
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        # transformers 5.x renamed the forward's ``past_key_values`` to ``cache``.
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"

    # -- plain calls -----------------------------------------------------------------------

    def __call__(self, inputs: list, max_tokens: int = 16, **kwargs) -> list:
        if kwargs:
            raise TypeError(f"causal_lm takes only max_tokens as a call option, got {sorted(kwargs)}")
        if not all(isinstance(text, str) for text in inputs):
            raise TypeError("causal_lm takes strings (the prompts to complete greedily)")
        requests = [{"prompt": text, "max_tokens": max_tokens, "temperature": 0.0} for text in inputs]
        answers = self.openai_batch(requests)
        for answer in answers:
            if "error" in answer:
                raise RequestError(answer["error"]["message"], answer["error"].get("param"))
        return [answer["text"] for answer in answers]

    # -- the API's batch ---------------------------------------------------------------------

    def openai_batch(
        self,
        requests: list[dict],
        on_done: Callable[[int, dict], None] | None = None,
        on_delta: Callable[[int, dict], None] | None = None,
        cancelled: Callable[[int], bool] | None = None,
    ) -> list[dict]:
        """Answer every request of a batch (the keys ``openai_shapes`` gives them). ``on_done(i,
        answer)`` is called as soon as request ``i`` is answered: a prompt to score, a bad request
        or a short generation is answered before the batch's longest generation is done.
        ``on_delta(i, delta)``: the parts of a streamed request as they are made (see the module
        docstring); ``cancelled(i)``: whether request ``i``'s caller has gone away."""
        answers: list[dict | None] = [None] * len(requests)

        def streams(index: int) -> bool:
            return on_delta is not None and bool(requests[index].get("stream"))

        def settle(index: int, answer: dict) -> None:
            answers[index] = answer
            if "error" in answer and streams(index):
                assert on_delta is not None
                on_delta(index, answer)  # before any text of the batch: the server can still answer a 400
            if "error" not in answer:
                self.usage["prompt_tokens"] += answer.get("prompt_tokens", 0)
                self.usage["completion_tokens"] += answer.get("completion_tokens", 0)
            if on_done is not None:
                on_done(index, answer)

        encoded = self._encode_batch(requests)
        prepared: list[tuple[int, dict, list[int], list[int] | None]] = []
        for index, request in enumerate(requests):
            try:
                ids, starts = self._prompt_ids(request, encoded.get(index))
            except RequestError as exc:
                settle(index, {"error": {"message": str(exc), "param": exc.param}})
                continue
            prepared.append((index, request, ids, starts))
        scored = [(i, ids) for i, r, ids, _ in prepared if r.get("echo") and r.get("logprobs") is not None]
        scores = (
            self._score([ids for _, ids in scored], max(self._top(requests[i]) for i, _ in scored)) if scored else []
        )
        score_of = {i: s for (i, _), s in zip(scored, scores, strict=True)}
        generating = []
        for index, request, ids, starts in prepared:
            if request.get("max_tokens", 16) > 0:
                generating.append((index, request, ids, starts))
            else:
                settle(index, self._answer(request, ids, starts, score_of.get(index), None))
        if generating:
            emitters: list[Callable[[dict], None] | None] = []
            bases: list[int] = []
            for index, request, ids, starts in generating:
                emitter = None
                if streams(index):
                    assert on_delta is not None
                    emitter = functools.partial(on_delta, index)
                    head = self._answer(request, ids, starts, score_of.get(index), None)
                    emitter({key: head[key] for key in ("prompt_text", "prompt_tokens", "logprobs")})
                emitters.append(emitter)
                bases.append(len(self._prompt_text(request, ids)) if request.get("echo") else 0)

            def finished(position: int, generation: dict) -> None:
                index, request, ids, starts = generating[position]
                settle(index, self._answer(request, ids, starts, score_of.get(index), generation))

            def gone(position: int) -> bool:
                return cancelled is not None and cancelled(generating[position][0])

            self._generate(
                [(r, ids) for _, r, ids, _ in generating], finished, emitters=emitters, bases=bases, gone=gone
            )
        return [answer for answer in answers if answer is not None]

    def _prompt_text(self, request: dict, ids: list[int]) -> str:
        prompt = request.get("prompt", "")
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    @staticmethod
    def _top(request: dict) -> int:
        return int(request.get("logprobs") or 0)

    def _encode_batch(self, requests: list[dict]) -> dict[int, tuple[list[int], list[int]]]:
        """The token ids and character starts of every plain string prompt of the batch, in one
        call of the tokenizer (one call per prompt cost more than the forward pass of a small
        model). Chat requests are left to ``_prompt_ids``: their template comes first."""
        texts = {
            index: request.get("prompt", "")
            for index, request in enumerate(requests)
            if "messages" not in request and isinstance(request.get("prompt", ""), str)
        }
        if not texts:
            return {}
        encoded = self.tokenizer(list(texts.values()), add_special_tokens=False, return_offsets_mapping=True)
        return {
            index: (list(ids), [start for start, _ in offsets])
            for index, ids, offsets in zip(texts, encoded["input_ids"], encoded["offset_mapping"], strict=True)
        }

    def _prompt_ids(
        self, request: dict, encoded: tuple[list[int], list[int]] | None = None
    ) -> tuple[list[int], list[int] | None]:
        """The prompt's token ids and each token's character start (None for a token prompt);
        ``encoded``: what ``_encode_batch`` made of its string prompt."""
        if "messages" in request:
            if not self.has_chat_template:
                raise RequestError("this model's tokenizer has no chat template: use /completions", "messages")
            try:
                text = self.tokenizer.apply_chat_template(
                    request["messages"], tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # a template that rejects these messages (roles, alternation)
                raise RequestError(f"the chat template rejects these messages: {exc}", "messages") from None
            request["prompt"] = text
        prompt = request.get("prompt", "")
        if encoded is not None:
            ids, starts = encoded
        elif isinstance(prompt, list):
            ids = [int(token) for token in prompt]
            if any(token < 0 or token >= len(self.tokenizer) for token in ids):
                raise RequestError(
                    f"a token id of the prompt is outside the vocabulary (0..{len(self.tokenizer) - 1})", "prompt"
                )
            starts = None
        else:
            alone = self.tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(alone["input_ids"])
            starts = [start for start, _ in alone["offset_mapping"]]
        if len(ids) > self.context:
            raise RequestError(
                f"the prompt is {len(ids)} tokens long; this model's context is {self.context} tokens", "prompt"
            )
        return ids, starts

    def _token_text(self, token: int) -> str:
        """A token's text; a byte-level token that is part of a character is written as OpenAI
        writes it, ``bytes:\\xe2\\x80``, so that different tokens never read the same."""
        text = self._texts.get(token)
        if text is None:
            text = self.tokenizer.decode([token])
            if "\ufffd" in text:
                piece = self.tokenizer.convert_ids_to_tokens(token)
                decoder = _byte_decoder()
                if isinstance(piece, str) and piece and all(c in decoder for c in piece):
                    raw = bytes(decoder[c] for c in piece)
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._texts[token] = text
        return text

    # -- scoring ---------------------------------------------------------------------------------

    def _score(self, prompts: list[list[int]], top: int) -> list[list[tuple[float, list[tuple[int, float]]] | None]]:
        """Each prompt token's log-probability given the tokens before it: ``[None, (logprob,
        [(token, logprob), ...top]), ...]`` per prompt. The prompts go through padded forward
        passes of similar lengths whose logits stay within ``SCORE_LOGITS_BYTES`` (one pass for
        most batches), and their log-probabilities over the vocabulary are computed in blocks of
        ``SCORE_CHUNK_BYTES`` at most: what is kept is only the figures asked for. The whole
        batch's log-probabilities at once took a batch x length x vocabulary float32 tensor (two
        for a half-precision model): gigabytes for a real vocabulary and long prompts."""
        results: list[list[tuple[float, list[tuple[int, float]]] | None]] = [[] for _ in prompts]
        vocab = int(getattr(self.model.config, "vocab_size", 0) or len(self.tokenizer))
        group: list[int] = []
        for index in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
            if not prompts[index]:
                continue  # (nothing to score: no entries)
            # Sorted by length: this prompt is the longest of the group it would join.
            if group and (len(group) + 1) * len(prompts[index]) * vocab * 4 > SCORE_LOGITS_BYTES:
                self._score_pass([prompts[i] for i in group], top, vocab, [results[i] for i in group])
                group = []
            group.append(index)
        if group:
            self._score_pass([prompts[i] for i in group], top, vocab, [results[i] for i in group])
        return results

    def _score_pass(self, prompts: list[list[int]], top: int, vocab: int, into: list[list]) -> None:
        """One right-padded forward pass of ``prompts`` (none empty); each one's scores are
        appended to its list of ``into``. The log-probabilities are computed in blocks of rows and
        positions of at most ``SCORE_CHUNK_BYTES``: the whole pass in one block for a small
        vocabulary (a few tensor operations for the batch), a few positions of one prompt at a
        time for a large one."""
        import torch

        longest = max(len(ids) for ids in prompts)
        input_ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        scored = longest - 1  # positions with a next token
        per_position = 4 * vocab  # (float32)
        rows_per_block = max(1, SCORE_CHUNK_BYTES // (per_position * max(1, scored)))
        positions_per_block = max(1, scored if rows_per_block > 1 else SCORE_CHUNK_BYTES // per_position)
        for row in range(len(prompts)):
            into[row].append(None)  # (the first token: nothing before it)
        with torch.inference_mode():
            input_ids = input_ids.to(self.device)
            logits = self.model(input_ids=input_ids, attention_mask=mask.to(self.device)).logits
            for first_row in range(0, len(prompts), rows_per_block):
                rows = range(first_row, min(first_row + rows_per_block, len(prompts)))
                for start in range(0, scored, positions_per_block):
                    end = min(start + positions_per_block, scored)
                    # On the model's device; only the figures asked for are copied back.
                    logprobs = torch.log_softmax(logits[rows.start : rows.stop, start:end].float(), dim=-1)
                    targets = input_ids[rows.start : rows.stop, start + 1 : end + 1].unsqueeze(-1)
                    chosen = logprobs.gather(2, targets).squeeze(-1).tolist()
                    if top:
                        best = torch.topk(logprobs, top, dim=-1)
                        top_ids, top_values = best.indices.tolist(), best.values.tolist()
                    del logprobs
                    for k, row in enumerate(rows):
                        for j in range(min(end, len(prompts[row]) - 1) - start):
                            pairs = list(zip(top_ids[k][j], top_values[k][j], strict=True)) if top else []
                            into[row].append((chosen[k][j], pairs))

    # -- generation -----------------------------------------------------------------------------

    def _generate(
        self,
        batch: list[tuple[dict, list[int]]],
        finished: Callable[[int, dict], None],
        emitters: list[Callable[[dict], None] | None] | None = None,
        bases: list[int] | None = None,
        gone: Callable[[int], bool] | None = None,
    ) -> None:
        """Generate for every request of ``batch`` together, one token per step for the requests
        not yet done; ``finished(position, generation)`` as each is done, with ``{"ids",
        "logprobs", "tops", "text", "finish_reason", "pieces"}``. ``emitters[position]``: where a
        streamed request's final tokens go as they are made (``bases``: where its generated text
        starts in the choice's text); ``gone(position)``: its caller has gone away."""
        import torch

        states = []
        for position, (request, ids) in enumerate(batch):
            context_ids = ids if ids else ([self.bos_id] if self.bos_id is not None else [self.pad_id])
            room = self.context - len(context_ids)
            wanted = int(request.get("max_tokens", 16))
            seed = request.get("seed")
            stops = list(request.get("stop") or [])
            generator = None
            if float(request.get("temperature", 1.0)) > 0:
                generator = torch.Generator().manual_seed(
                    int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
                )
            states.append(
                {
                    "request": request,
                    "context": context_ids,
                    "limit": max(0, min(wanted, room)),
                    "ids": [],
                    "logprobs": [],
                    "tops": [],
                    "text": "",
                    "finish_reason": "length",
                    "done": room <= 0 or wanted <= 0,
                    "generator": generator,
                    "top": int(request.get("logprobs") or 0),
                    "stop": stops,
                    "stops": StopStrings(stops),  # how far the text so far matches each
                    "position": position,
                    # The text so far, decoded a token at a time, and where each token's starts.
                    "decoded": IncrementalText(self._decode_generated),
                    "offsets": [],
                    # Streaming: how many tokens were sent and how many characters those hold.
                    "emit": emitters[position] if emitters else None,
                    "base": bases[position] if bases else 0,
                    "sent": 0,
                    "sent_chars": 0,
                }
            )

        def done(state: dict) -> None:
            self._finish_text(state)
            if state["emit"] is not None:
                self._send(state, len(state["ids"]), state["pieces"])
            keys = ("ids", "logprobs", "tops", "text", "finish_reason", "pieces", "offsets")
            finished(state["position"], {key: state[key] for key in keys})

        def step(state: dict) -> None:
            """After a token of a live request: stop it if its caller went away; stream what is final."""
            if gone is not None and gone(state["position"]):
                state["done"], state["finish_reason"] = True, "cancelled"
            elif state["emit"] is not None:
                self._advance_stream(state)

        live = []
        for state in states:
            if state["done"]:
                done(state)
            else:
                live.append(state)
        if live:
            self._decode(live, done, step)

    def _decode_generated(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance_stream(self, state: dict) -> None:
        """Send every token whose text can no longer change: not after the start of a possible
        stop string, nor inside a character."""
        decoded: IncrementalText = state["decoded"]
        safe = decoded.length - state["stops"].held
        count, chars = state["sent"], state["sent_chars"]
        while count < len(decoded.pieces):
            piece = decoded.pieces[count]
            # A token is final when it starts before the safe end and ends within it: a stop
            # string found later starts at or after the safe end, and cuts no sent token.
            if not (chars < safe and chars + len(piece) <= safe):
                break
            chars += len(piece)
            count += 1
        self._send(state, count, decoded.pieces)

    def _send(self, state: dict, upto: int, pieces: list[str]) -> None:
        """Stream the tokens ``state["sent"]:upto`` (their ``pieces`` and, when asked, entries)."""
        start = state["sent"]
        if upto <= start:
            return
        entries = None
        if state["request"].get("logprobs") is not None:
            entries = [
                self._entry(
                    state["ids"][j],
                    state["logprobs"][j],
                    state["tops"][j] if state["tops"] else [],
                    state["base"] + state["offsets"][j],
                )
                for j in range(start, upto)
            ]
        sent = pieces[start:upto]
        state["sent"], state["sent_chars"] = upto, state["sent_chars"] + sum(len(p) for p in sent)
        state["emit"]({"pieces": sent, "logprobs": entries})

    def _entry(self, token: int, logprob: float, tops: list, offset: int) -> dict:
        """A generated token's ``logprobs`` entry."""
        return {
            "token": self._token_text(token),
            "logprob": json_logprob(logprob),
            "top": [(self._token_text(t), json_logprob(v)) for t, v in tops],
            "offset": offset,
        }

    def _decode(self, live: list[dict], done: Callable[[dict], None], step: Callable[[dict], None]) -> None:
        """The step loop: a left-padded prefill, then one token per step with the KV cache; rows
        that are done drop out of the computation (the cache keeps only the live rows)."""
        import torch

        longest = max(len(s["context"]) for s in live)
        input_ids = torch.full((len(live), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(live), longest), dtype=torch.long)
        for row, state in enumerate(live):
            n = len(state["context"])
            input_ids[row, longest - n :] = torch.tensor(state["context"], dtype=torch.long)
            mask[row, longest - n :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rows = list(live)
        past = None
        step_input = input_ids
        step_positions = positions
        with torch.inference_mode():
            while rows:
                out = self.model(
                    input_ids=step_input,
                    attention_mask=mask,
                    position_ids=step_positions,
                    use_cache=True,
                    **({self._cache_argument: past} if past is not None else {}),
                )
                past = out.get("cache", None) or out.get("past_key_values", None)
                logits = out.logits[:, -1, :].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                chosen: list[int] = []
                for row, state in enumerate(rows):
                    token = self._pick(logits[row], state)
                    chosen.append(token)
                    state["ids"].append(token)
                    state["offsets"].append(state["decoded"].reach)
                    state["decoded"].add(token)
                    state["logprobs"].append(float(logprobs[row, token]))
                    if state["top"]:
                        top = torch.topk(logprobs[row], state["top"])
                        state["tops"].append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
                    self._check_done(state, token)
                    if not state["done"]:
                        step(state)
                    if state["done"]:
                        done(state)
                keep = [row for row, state in enumerate(rows) if not state["done"]]
                if not keep:
                    break
                next_tokens = torch.tensor(chosen, dtype=torch.long, device=self.device).unsqueeze(1)
                next_positions = step_positions[:, -1:] + 1
                if len(keep) < len(rows):
                    index = torch.tensor(keep, dtype=torch.long, device=self.device)
                    past.batch_select_indices(index)
                    mask, next_tokens, next_positions = mask[index], next_tokens[index], next_positions[index]
                    rows = [rows[row] for row in keep]
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=self.device)], dim=1)
                step_input, step_positions = next_tokens, next_positions

    def _pick(self, logits, state: dict) -> int:
        import torch

        request = state["request"]
        temperature = float(request.get("temperature", 1.0))
        if temperature < GREEDY_BELOW:
            return int(torch.argmax(logits))
        # Shifted by the largest logit first, every value is <= 0: no division by a small
        # temperature overflows to inf (inf - inf in the softmax is a NaN, which multinomial
        # refuses, failing the whole batch).
        logits = logits.float()
        probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
        top_p = float(request.get("top_p", 1.0))
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always).
            outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs.cpu()
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return int(torch.argmax(logits))  # (logits that were not finite: nothing to sample from)
        return int(torch.multinomial(probs, 1, generator=state["generator"]))

    def _check_done(self, state: dict, token: int) -> None:
        if self.eos_id is not None and token == self.eos_id:
            state["done"], state["finish_reason"] = True, "stop"
            return
        if state["stop"]:
            # The text this token settled, read once, then (not kept) the text of a token that
            # ends inside a character: a stop string found in neither was not in the text. The
            # U+FFFD that stands for the unfinished character is not text yet (a stop string may
            # hold U+FFFD): what that character is comes with the token that settles it.
            decoded: IncrementalText = state["decoded"]
            stops: StopStrings = state["stops"]
            if stops.feed(decoded.pieces[-1]) or stops.ends_in(decoded.pending.rstrip(REPLACEMENT)):
                state["done"], state["finish_reason"] = True, "stop"
                return
        if len(state["ids"]) >= state["limit"]:
            state["done"] = True

    def _finish_text(self, state: dict) -> None:
        """The generated text (cut before the first stop string, without an end-of-text token)
        and its pieces, one per kept token, that add up to it (what a stream sends)."""
        ids = state["ids"]
        # The end-of-text token that ended the text adds nothing to it, but it stays a generated
        # token (counted, with its log-probability): lm-eval's local-completions reads an echoed
        # prompt's scores as every entry but the last generated one.
        ended = bool(ids) and self.eos_id is not None and ids[-1] == self.eos_id
        if ended:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((text.find(stop) for stop in state["stop"] if stop in text), default=-1)
        # The pieces as decoded a token at a time; a last token that ends inside a character
        # (the generation stopped there) gets that character's start as well.
        pieces = state["decoded"].pieces[: len(ids)]
        if pieces:
            length = sum(map(len, pieces))
            if len(text) > length and text.startswith("".join(pieces)):
                pieces[-1] += text[length:]
        if cut >= 0:
            text = text[:cut]
            kept, length = [], 0
            for piece in pieces:
                if length >= cut:
                    break
                kept.append(piece[: cut - length])
                length += len(piece)
            pieces = kept
            ids = ids[: len(pieces)]
        elif ended:
            ids, pieces = [*ids, state["ids"][-1]], [*pieces, ""]
        state["ids"], state["text"], state["pieces"] = ids, text, pieces
        state["logprobs"], state["tops"] = state["logprobs"][: len(ids)], state["tops"][: len(ids)]
        state["offsets"] = state["offsets"][: len(ids)]

    # -- the answer ------------------------------------------------------------------------------

    def _answer(
        self,
        request: dict,
        ids: list[int],
        starts: list[int] | None,
        score: list | None,
        generation: dict | None,
    ) -> dict:
        prompt_text = self._prompt_text(request, ids)
        gen = generation or {
            "ids": [],
            "logprobs": [],
            "tops": [],
            "text": "",
            "finish_reason": "length",
            "pieces": [],
            "offsets": [],
        }
        answer: dict[str, Any] = {
            "prompt_text": prompt_text,
            "text": gen["text"],
            "pieces": gen["pieces"],
            "finish_reason": gen["finish_reason"],
            "prompt_tokens": len(ids),
            "completion_tokens": len(gen["ids"]),
            "logprobs": None,
        }
        if request.get("logprobs") is None:
            return answer
        tokens: list[dict] = []
        top = self._top(request)
        if request.get("echo"):
            if starts is None:  # a token prompt: offsets in its decoded text
                starts = offsets(self.tokenizer.decode, ids)
            for position, token in enumerate(ids):
                entry = score[position] if score else None
                tokens.append(
                    {
                        "token": self._token_text(token),
                        "logprob": None if entry is None else json_logprob(entry[0]),
                        "top": None
                        if entry is None
                        else [(self._token_text(t), json_logprob(v)) for t, v in entry[1][:top]],
                        "offset": starts[position],
                    }
                )
        base = len(prompt_text) if request.get("echo") else 0
        for position, token in enumerate(gen["ids"]):
            tops = gen["tops"][position] if gen["tops"] else []
            tokens.append(self._entry(token, gen["logprobs"][position], tops, base + gen["offsets"][position]))
        answer["logprobs"] = tokens
        return answer


def json_logprob(value: float) -> float | None:
    """A log-probability as JSON can carry it: JSON has no infinities and no NaN. -inf (a token
    the model rules out) is sent as a very low number, as vLLM does; NaN (a forward pass that
    overflowed, in float16) is no figure at all: null, rather than a number that looks right."""
    if math.isfinite(value):
        return value
    return -9999.0 if value < 0 else None


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character table (byte-level BPE tokens are written in it)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


def load_causal_lm(model: str, device: str = "cpu", dtype: str | None = None, **options) -> CausalLM:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(model):  # a local directory only: a host never downloads a model
        raise FileNotFoundError(f"causal_lm: {model!r} is not a directory (a model saved with save_pretrained)")
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    kwargs: dict[str, Any] = {"local_files_only": True, **options}
    if dtype in _DTYPES:
        kwargs["dtype"] = getattr(torch, _DTYPES[dtype])
    network: Any = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    network = network.to(device).eval()
    return CausalLM(network, tokenizer, device)
