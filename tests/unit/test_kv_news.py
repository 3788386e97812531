"""`KvNews`: what a shard tells its token engine about KV that landed or was lost, once each."""

from __future__ import annotations

import threading

from services.shard.kv_news import KvNews


def test_news_is_told_once_and_an_empty_drain_takes_nothing() -> None:
    news = KvNews()
    assert news.drain() == ([], [])
    news.landed("a")
    news.lost("b")
    news.landed("c")
    assert news.drain() == (["a", "c"], ["b"])
    assert news.drain() == ([], [])


def test_a_waiting_drain_gets_news_that_lands_while_it_waits() -> None:
    news = KvNews()
    timer = threading.Timer(0.05, news.landed, args=("late",))
    timer.start()
    try:
        assert news.drain(wait_s=30.0) == (["late"], [])
    finally:
        timer.cancel()
