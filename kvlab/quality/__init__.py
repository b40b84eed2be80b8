"""kvlab quality: how far a cheaper setting (a quantized KV cache, fewer weight bits) moves the model.

    text ─► token windows ─► reference (float32 KV, the model's own weights) ─┐
                           └► the chosen setting, through its own cache ──────┴► per position:
                              KL divergence, same top token, log-probability of the true next token

    text.py      the text it reads: the Python standard library's own sources (offline), or --text FILE
    measure.py   the two runs side by side, window by window, and the statistics (llama.cpp's
                 --kl-divergence ones: mean / p99 KLD, same top p, both perplexities) with a verdict
    store.py     results kept per model and setting ($KVLAB_HOME/quality); the warning run and serve print
    cli.py       `kvlab quality MODEL --kv-cache-dtype q8_0`
"""
