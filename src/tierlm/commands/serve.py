"""Tier 3: `tierlm serve` — a trained chat model behind an OpenAI-compatible HTTP API (FastAPI + uvicorn)
and a one-page chat UI.

    POST /v1/chat/completions   {messages, temperature, max_tokens, stream, seed}: a chat.completion, or
                                with "stream": true server-sent chat.completion.chunk events, then [DONE]
    GET  /v1/models             the one model served
    GET  /                      the chat page (it streams from the endpoint above)

Any OpenAI client works: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")`.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoint's request model from its
# annotation, which must be the class itself (it is defined inside create_app).
import json
import queue
import threading
import time
import uuid

from tierlm.commands.chat import Chatbot
from tierlm.errors import ConfigError, DataError


def create_app(bot: Chatbot):
    """The FastAPI app answering for `bot`."""
    try:
        from fastapi import FastAPI, HTTPException
        from fastapi.responses import HTMLResponse, StreamingResponse
        from pydantic import BaseModel, Field
    except ImportError:
        raise ConfigError("tierlm serve needs fastapi and uvicorn: pip install 'tierlm[serve]'") from None

    class Message(BaseModel):
        role: str
        content: str

    class ChatRequest(BaseModel):
        model: str | None = None
        messages: list[Message]
        temperature: float = Field(0.7, ge=0, le=5)
        max_tokens: int = Field(128, ge=1, le=8192)
        stream: bool = False
        seed: int | None = None

    app = FastAPI(title="tierlm", version="0.1.0")

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return CHAT_PAGE.replace("{{MODEL}}", bot.name)

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": bot.name, "object": "model", "created": 0, "owned_by": "tierlm"}]}

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest):
        messages = [m.model_dump() for m in request.messages]
        ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        settings = dict(temperature=request.temperature, max_new_tokens=request.max_tokens, seed=request.seed)
        if not request.stream:
            try:
                reply = bot.reply(messages, **settings)
            except DataError as e:
                raise HTTPException(status_code=400, detail=str(e)) from None
            return {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": bot.name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply.text},
                        "finish_reason": reply.finish_reason,
                    }
                ],
                "usage": {
                    "prompt_tokens": reply.prompt_tokens,
                    "completion_tokens": reply.completion_tokens,
                    "total_tokens": reply.prompt_tokens + reply.completion_tokens,
                },
            }

        def chunk(delta: dict, finish_reason: str | None = None) -> str:
            body = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": bot.name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            }
            return f"data: {json.dumps(body)}\n\n"

        def events():
            pieces: queue.Queue = queue.Queue()

            def generate() -> None:
                try:
                    pieces.put(
                        ("done", bot.reply(messages, on_text=lambda text: pieces.put(("text", text)), **settings))
                    )
                except DataError as e:
                    pieces.put(("error", str(e)))

            threading.Thread(target=generate, daemon=True, name="tierlm-generate").start()
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, value = pieces.get()
                if kind == "text":
                    yield chunk({"content": value})
                    continue
                if kind == "error":
                    yield f"data: {json.dumps({'error': {'message': value, 'type': 'invalid_request_error'}})}\n\n"
                else:
                    yield chunk({}, value.finish_reason)
                break
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def check_port(port: int) -> None:
    """A TCP port (0: any free one); checked before the model is loaded."""
    if not 0 <= port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {port}")


def serve(bot: Chatbot, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("tierlm serve needs fastapi and uvicorn: pip install 'tierlm[serve]'") from None
    check_port(port)
    print(
        f"serving {bot.name}: chat page http://{host}:{port}/ , API http://{host}:{port}/v1 (Ctrl-C stops)", flush=True
    )
    uvicorn.run(create_app(bot), host=host, port=port, log_level="warning")


CHAT_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tierlm chat: {{MODEL}}</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; display: flex; flex-direction: column; height: 100vh; background: #f6f6f4; }
  header { padding: 0.6em 1em; background: #222; color: #eee; display: flex; gap: 1em; align-items: center; }
  header span { flex: 1; }
  #log { flex: 1; overflow-y: auto; padding: 1em; }
  .message { max-width: 46em; margin: 0.4em 0; padding: 0.6em 0.9em; border-radius: 0.6em; white-space: pre-wrap; }
  .user { background: #dde8ff; margin-left: auto; }
  .assistant { background: #fff; border: 1px solid #ddd; }
  form { display: flex; gap: 0.5em; padding: 0.8em; background: #eee; }
  textarea { flex: 1; font: inherit; padding: 0.5em; resize: none; }
  button { font: inherit; padding: 0 1.2em; }
</style>
</head>
<body>
<header><span>tierlm chat: <b>{{MODEL}}</b></span>
  <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.7" style="width:4em"></label>
  <button id="reset" type="button">new chat</button></header>
<div id="log"></div>
<form id="form"><textarea id="input" rows="2" placeholder="Ask something (Enter sends, Shift+Enter: new line)"></textarea>
  <button id="send" type="submit">Send</button></form>
<script>
const log = document.getElementById("log"), input = document.getElementById("input"), form = document.getElementById("form");
let history = [];
function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
  return div;
}
document.getElementById("reset").onclick = () => { history = []; log.innerHTML = ""; input.focus(); };
input.addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); form.requestSubmit(); } });
form.onsubmit = async (e) => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  bubble("user", text);
  history.push({role: "user", content: text});
  const answer = bubble("assistant", "");
  answer.dataset.done = "false";
  const response = await fetch("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({messages: history, stream: true, temperature: parseFloat(document.getElementById("temperature").value)})});
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  while (true) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const event = JSON.parse(line.slice(6));
      if (event.error) { answer.textContent += " (" + event.error.message + ")"; continue; }
      answer.textContent += event.choices[0].delta.content || "";
      log.scrollTop = log.scrollHeight;
    }
  }
  answer.dataset.done = "true";
  history.push({role: "assistant", content: answer.textContent});
};
input.focus();
</script>
</body>
</html>
"""
