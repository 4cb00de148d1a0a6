"""Exercise (lesson 9, "Prefix caching"): chained block keys, the lookup, and LRU eviction.

Write a small prefix-caching block pool of your own, on plain lists and dicts, that makes the
same choices as the reference BlockSpaceManager with enable_prefix_caching=True (lesson 9):
which cached blocks a new request reuses, which free blocks it takes, and which cached blocks
that evicts. Use block_key below (the real one) for the keys.

Check your work with

    pytest lessons/exercises/test_prefix_cache_exercise.py

The test replays streams of requests that share system prompts through the real manager
(reference/kv/block_manager.py and reference/kv/prefix_cache.py) in pools small enough to
evict, and compares your keys, block tables and cached-token counts with the manager's. Until
you edit this file the test reports your version as skipped and checks only the solution.

한국어:
연습 문제(9강, "프리픽스 캐싱"): 사슬로 이어진 블록 키, 조회, LRU 축출.

평범한 리스트와 딕셔너리로, 프리픽스 캐싱(prefix caching)을 하는 작은 블록 풀을 직접 작성하세요.
enable_prefix_caching=True인 레퍼런스 BlockSpaceManager와 같은 선택을 해야 합니다(9강): 새 요청이
어떤 캐시된 블록을 재사용하는지, 어떤 빈 블록을 가져가는지, 그 때문에 어떤 캐시된 블록이
축출되는지입니다. 키에는 아래의 block_key(실제 함수)를 쓰세요.

다음 명령으로 확인하세요:

    pytest lessons/exercises/test_prefix_cache_exercise.py

테스트는 시스템 프롬프트를 공유하는 요청 스트림을 축출이 일어날 만큼 작은 풀에서 실제
관리자(reference/kv/block_manager.py와 reference/kv/prefix_cache.py)로 재생하고, 여러분의 키, 블록
테이블, 캐시된 토큰 수를 관리자의 것과 비교합니다. 이 파일을 고치기 전까지 테스트는 여러분의
버전을 skipped로 보고하고 해답만 확인합니다.
"""

from pagedllm.reference.kv.prefix_cache import block_key  # noqa: F401 (yours to use)


def chain_keys(token_ids: list[int], block_size: int) -> list[str]:
    """The keys of the full blocks of token_ids, in order (a partly filled last block has none).

    Example: with blocks of 4, 9 tokens have 2 full blocks, so 2 keys; a different token in the
    first block changes both keys, a different token in the second block only the second.
    """
    raise NotImplementedError("exercise: implement chain_keys")


def replay(events: list[tuple], num_blocks: int, block_size: int) -> list[tuple[list[int], int]]:
    """Replay admissions and frees on a pool of num_blocks blocks; one result per admission.

    events, in order:
      ("admit", request_id, token_ids): a request arrives with this prompt. Give it blocks for
          all len(token_ids) tokens, reusing the longest chain of cached blocks the lookup finds;
          then its prefill runs, and every full block of its prompt becomes findable.
      ("free", request_id): the request finishes and frees its blocks.
    Every admission in the events fits the pool.

    Returns, for each admission, (its block table, how many of its tokens came from the cache).

    The pool starts with blocks 0 .. num_blocks - 1 all free, and follows lesson 9's rules:
    - the lookup leaves at least the prompt's last token to compute;
    - a cached block that is free is taken back out of the free list; one that another request
      holds is shared (reference counts);
    - other blocks come from the front of the free list, and a freed block joins at the back,
      a request's blocks deepest first; a block keeps its key until it is handed out for new
      content (lazy eviction);
    - if a key is already cached in another block, that block keeps it.

    Example (the session of lesson 9, blocks of 4, a pool of 10): A = 8 system tokens + 5, then
    B = the same 8 + 3 others: A gets ([0, 1, 2, 3], 0), B gets ([0, 1, 4], 8).
    """
    # The state: the free list (a collections.deque), a reference count per block, key -> block
    # and block -> key for the cache, and each live request's block table.
    raise NotImplementedError("exercise: implement replay")
