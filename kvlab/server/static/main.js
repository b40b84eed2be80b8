// The page's start: ask whether the server wants an API key (an open endpoint, so the page never
// fails on a 401 first), take the key once if it does, then start the chat, the engine panel and
// the calculator.

import { HttpError, apiKey, getJSON, setApiKey } from "./api.js";
import { Calculator } from "./calculator.js";
import { Chat } from "./chat.js";
import { EnginePanel } from "./engine.js";
import { bytes, count } from "./format.js";

const dialog = document.getElementById("key-dialog");

function askForKey(message = "") {
  document.getElementById("key-error").textContent = message;
  if (!dialog.open) dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(), { once: true });
  });
}

document.getElementById("key-form").addEventListener("submit", () => {
  setApiKey(document.getElementById("key-input").value.trim());
});

async function modelInfo(keyRequired) {
  for (let message = ""; ;) {
    if (keyRequired && (!apiKey() || message)) await askForKey(message);
    try {
      return await getJSON("/api/web/model");
    } catch (e) {
      if (!(e instanceof HttpError) || e.status !== 401) throw e;
      message = "that key was refused: try again";
    }
  }
}

async function start() {
  const served = document.getElementById("served");
  try {
    const { api_key_required: keyRequired } = await getJSON("/api/web/access");
    const model = await modelInfo(keyRequired);
    const keyButton = document.getElementById("key-button");
    const reauth = () => askForKey("the server refused the key: enter it again");
    if (keyRequired) {
      keyButton.hidden = false;
      keyButton.addEventListener("click", () => askForKey());
    }
    served.textContent = `${model.model} on ${model.device}: context ${count(model.max_model_len)} tokens, ` +
      `KV pool ${count(model.kv_blocks_total)} blocks of ${count(model.block_size)} tokens, ` +
      `${bytes(model.device_memory_bytes)} of memory`;
    const engine = new EnginePanel(reauth);
    new Chat(model, () => engine.poll());
    new Calculator(model, reauth).update();
    engine.start();
    document.body.dataset.ready = "true";
  } catch (e) {
    served.textContent = `cannot reach the server: ${e.message}`;
    served.className = "error";
  }
}

start();
