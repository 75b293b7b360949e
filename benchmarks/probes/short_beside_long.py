"""How long does a short request take beside a long prompt's prefill? (issue: fair admission)

Against a running `verispec serve`: an 8-token request 3 times alone, then up to 5 times one after the
other while a prompt of about 2,900 tokens is being prefilled. Prints the seconds of each and of the long
request, as JSON. The bar: beside the long prompt ≤ 2 × alone + 1 s.

    .venv/bin/python benchmarks/probes/short_beside_long.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

SENTENCE = "The committee reviewed the quarterly report and discussed the budget for the coming year in detail. "


async def measure(url: str, repeats: int = 160) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        short = {"model": model, "prompt": "Write a haiku about caches.", "max_tokens": 8, "temperature": 0}

        async def seconds(body: dict) -> float:
            start = time.perf_counter()
            (await http.post("/v1/completions", json=body)).raise_for_status()
            return time.perf_counter() - start

        alone = [await seconds(short) for _ in range(3)]
        long = asyncio.create_task(seconds({"model": model, "prompt": SENTENCE * repeats, "max_tokens": 4, "temperature": 0}))
        await asyncio.sleep(3)  # the long prompt is admitted and prefilling
        beside = []
        while not long.done() and len(beside) < 5:
            beside.append(await seconds(short))
        return {"alone_s": [round(s, 2) for s in alone], "beside_long_prompt_s": [round(s, 2) for s in beside],
                "long_request_s": round(await long, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    print(json.dumps(asyncio.run(measure(parser.parse_args().url))))


if __name__ == "__main__":
    main()
