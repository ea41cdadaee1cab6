//! The batch script spoken to in its own wire format (lua/batch.lua) at fixed times, so a batch
//! holds exactly the entries written, on every Redis version:
//! - concurrency leases: a batch reads the first leases of a list a few at a time
//!   (`LEASE_WINDOW` in lua/leases.lua) and keeps the count and the earliest expiry itself as its
//!   checks take leases and its releases end them, in any order, one by one or joined as one
//!   entry; every check's answer is compared with a model of the leases;
//! - claims (lua/claims.lua): the wait behind a claim past a token bucket's burst, and claims on
//!   a shape without metered units;
//! - a batch that fails part way, as a whole (malformed) or in one check (a stored count that is
//!   not an integer): what its checks counted is written, and the others answer.

use crate::common;

use std::collections::BTreeMap;

use common::redis_server::{TestRedis, unique_prefix};

/// The store's script as `EVALSHA` runs it (src/store/redis/script.rs), so the test runs on every
/// Redis version.
fn script() -> redis::Script {
    redis::Script::new(concat!(
        include_str!("../../lua/common.lua"),
        include_str!("../../lua/fixed_window.lua"),
        include_str!("../../lua/sliding_log.lua"),
        include_str!("../../lua/sliding_counter.lua"),
        include_str!("../../lua/token_bucket.lua"),
        include_str!("../../lua/leases.lua"),
        include_str!("../../lua/fair.lua"),
        include_str!("../../lua/entry.lua"),
        include_str!("../../lua/fast.lua"),
        include_str!("../../lua/claims.lua"),
        include_str!("../../lua/overrides.lua"),
        include_str!("../../lua/batch.lua"),
        "return batch(KEYS, ARGV)\n"
    ))
}

/// An hour ahead of Redis's clock (ms): nothing a test writes expires by Redis's time while it
/// runs.
fn hour_ahead() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    u64::try_from(now.as_millis()).unwrap() + 3_600_000
}

const MOST: u64 = 64;
const LEASE_MS: u64 = 60_000;

/// One request of a batch: a check that takes a lease, the release of lease `id`, or the
/// releases of one key's leases joined as one entry (src/store/redis/merge.rs).
#[derive(Debug, Clone)]
enum Entry {
    Check,
    Release(u64),
    Releases(Vec<u64>),
}

/// What a check answered: whether it took a lease (its id), the slots left and the ms until the
/// earliest lease ends.
type Answer = (Option<u64>, u64, u64);

/// Runs `entries` as one batch at `now_ms`; the checks' answers, in order.
fn run(
    client: &mut redis::Connection,
    keys: (&str, &str),
    now_ms: u64,
    entries: &[Entry],
) -> Vec<Answer> {
    let shape = format!("fw|2|1|0,0,0,0,0,0,{MOST},{LEASE_MS},0|1000000|3600000");
    let script = script();
    let mut invocation = script.prepare_invoke();
    invocation
        .arg(now_ms * 1_000)
        .arg(2)
        .arg("rl|1")
        .arg(&shape);
    for entry in entries {
        match entry {
            Entry::Check => invocation.key(keys.0).key(keys.1).arg(2),
            Entry::Release(id) => invocation.key(keys.1).arg(format!("1@{id}")),
            Entry::Releases(ids) => {
                let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
                invocation.key(keys.1).arg(format!("1@{}", ids.join(" ")))
            }
        };
    }
    let packed: Vec<u8> = invocation.invoke(client).unwrap();
    let mut reader = &packed[..];
    let items = rmp::decode::read_array_len(&mut reader).unwrap();
    let mut numbers = Vec::new();
    for _ in 0..items {
        numbers.push(rmp::decode::read_int::<i64, _>(&mut reader).unwrap());
    }
    let mut at = 1;
    let mut answers = Vec::new();
    for entry in entries {
        let first = numbers[at];
        let items = if first < 0 {
            at += 1;
            usize::try_from(-first).unwrap()
        } else {
            0
        };
        match entry {
            Entry::Release(_) | Entry::Releases(_) => at += items,
            Entry::Check if first >= 0 => {
                // The short form: the rule's remaining and reset, the slots', the lease.
                let slots = numbers[at + 2] as u64;
                let reset = numbers[at + 3] as u64;
                answers.push((Some(numbers[at + 4] as u64), slots, reset));
                at += 5;
            }
            Entry::Check => {
                // allowed, delay, the rule's remaining, reset and retry, the slots', the lease.
                let lease = numbers[at + 8] as u64;
                answers.push((
                    (lease > 0).then_some(lease),
                    numbers[at + 5] as u64,
                    numbers[at + 6] as u64,
                ));
                at += items;
            }
        }
    }
    answers
}

/// The leases held, by id, with their expiry; what a check of them answers at `now`.
fn model_check(held: &mut BTreeMap<u64, u64>, now_ms: u64, id: Option<u64>) -> Answer {
    if let Some(id) = id {
        assert_eq!(id / 1_000, now_ms + LEASE_MS, "lease {id} names its expiry");
        held.insert(id, now_ms + LEASE_MS);
    }
    let earliest = held.values().min().map_or(0, |expiry| expiry - now_ms);
    (id, MOST - held.len() as u64, earliest)
}

/// A rule's key and the leases' key of user ann under `prefix`.
fn lease_keys(prefix: &str) -> (String, String) {
    (
        format!("{prefix}:{{user:ann}}:jobs:fw:3600000:1000000"),
        format!("{prefix}:{{user:ann}}:jobs:leases"),
    )
}

/// 48 leases, one a millisecond from after `now_ms`, each taken alone (48 expiries), each
/// answer checked against the model `held`: their ids, in order.
fn take_one_a_millisecond(
    client: &mut redis::Connection,
    keys: (&str, &str),
    now_ms: &mut u64,
    held: &mut BTreeMap<u64, u64>,
) -> Vec<u64> {
    let mut ids = Vec::new();
    for _ in 0..48 {
        *now_ms += 1;
        let [answer] = run(client, keys, *now_ms, &[Entry::Check])[..] else {
            panic!("one answer")
        };
        assert_eq!(answer, model_check(held, *now_ms, answer.0));
        ids.push(answer.0.unwrap());
    }
    ids
}

/// Runs `entries` (checks and single releases) as one batch at `now_ms`, every answer compared
/// with the model `held` (its leases expired by then ended first): each check's lease, if it took
/// one.
fn run_against_model(
    client: &mut redis::Connection,
    keys: (&str, &str),
    now_ms: u64,
    entries: &[Entry],
    held: &mut BTreeMap<u64, u64>,
) -> Vec<Option<u64>> {
    held.retain(|_, expiry| *expiry > now_ms);
    let mut answered = run(client, keys, now_ms, entries).into_iter();
    let mut leases = Vec::new();
    for entry in entries {
        match entry {
            Entry::Release(id) => {
                assert!(held.remove(id).is_some(), "lease {id} released twice");
            }
            Entry::Releases(_) => unreachable!("joined releases are not modelled here"),
            Entry::Check => {
                let answer = answered.next().unwrap();
                assert_eq!(answer, model_check(held, now_ms, answer.0), "{entries:?}");
                leases.push(answer.0);
            }
        }
    }
    leases
}

#[test]
fn a_batch_keeps_the_count_and_the_earliest_lease_of_checks_and_releases_in_any_order() {
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let prefix = unique_prefix("lua-leases");
    let (rule, leases) = lease_keys(&prefix);
    let keys = (rule.as_str(), leases.as_str());
    let mut now_ms = hour_ahead();
    let mut held = BTreeMap::new();
    let ids = take_one_a_millisecond(&mut client, keys, &mut now_ms, &mut held);
    // Batches of releases (the oldest first, as requests mostly end, then out of order) and
    // checks between them: more releases of the earliest than a batch reads at once.
    let orders: [Vec<usize>; 3] = [
        (0..20).collect(),
        vec![25, 20, 47, 21, 22, 30, 23, 24, 46, 26],
        (27..46).rev().filter(|i| *i != 30).collect(),
    ];
    for order in orders {
        now_ms += 3;
        let mut entries = Vec::new();
        for (n, index) in order.iter().enumerate() {
            entries.push(Entry::Release(ids[*index]));
            if n % 3 == 2 {
                entries.push(Entry::Check);
            }
        }
        entries.push(Entry::Check);
        let leases = run_against_model(&mut client, keys, now_ms, &entries, &mut held);
        assert!(leases.iter().all(Option::is_some), "a slot was free");
    }
    let count: u64 = redis::cmd("LLEN").arg(&leases).query(&mut client).unwrap();
    assert_eq!(count, held.len() as u64);
}

#[test]
fn a_hot_keys_checks_in_one_batch_take_leases_past_expired_ones_up_to_the_limit() {
    // A batch's first check of a key reads its leases; the checks after it take theirs from what
    // the batch knows (lua/leases.lua, lease_take_known) until a release or a full list sends
    // them the long way again: every answer is the model's, expired leases ended first.
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let prefix = unique_prefix("lua-hot-leases");
    let (rule, leases) = lease_keys(&prefix);
    let keys = (rule.as_str(), leases.as_str());
    let mut now_ms = hour_ahead();
    let mut held = BTreeMap::new();
    take_one_a_millisecond(&mut client, keys, &mut now_ms, &mut held);
    // The two earliest leases expire as the next batch runs.
    now_ms = *held.values().min().unwrap() + 1;
    let mut check_batch = |entries: &[Entry], held: &mut BTreeMap<u64, u64>, now_ms: u64| {
        let leases = run_against_model(&mut client, keys, now_ms, entries, held);
        leases.into_iter().flatten().collect::<Vec<_>>()
    };
    // 20 checks: 18 take the slots left, 2 are refused.
    let taken = check_batch(&vec![Entry::Check; 20], &mut held, now_ms);
    assert_eq!(taken.len(), 18, "46 held after the two expired");
    assert_eq!(held.len() as u64, MOST);
    // Releases between checks, in a batch of the same millisecond (nothing more expires): each
    // sends the next check the long way, and it finds the slot.
    let entries = [
        Entry::Release(taken[3]),
        Entry::Check,
        Entry::Check,
        Entry::Release(taken[0]),
        Entry::Release(taken[17]),
        Entry::Check,
        Entry::Check,
        Entry::Check,
    ];
    let again = check_batch(&entries, &mut held, now_ms);
    assert_eq!(again.len(), 3, "as many taken as released");
    let count: u64 = redis::cmd("LLEN").arg(&leases).query(&mut client).unwrap();
    assert_eq!(count, held.len() as u64);
}

#[test]
fn releases_joined_as_one_entry_end_their_leases_wherever_they_are() {
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let prefix = unique_prefix("lua-joined");
    let (rule, leases) = lease_keys(&prefix);
    let keys = (rule.as_str(), leases.as_str());
    let mut now_ms = hour_ahead();
    let mut held = BTreeMap::new();
    let ids = take_one_a_millisecond(&mut client, keys, &mut now_ms, &mut held);
    let some = |indexes: &[usize]| indexes.iter().map(|&i| ids[i]).collect::<Vec<_>>();
    // The first 20 (more than a batch reads at once); then some out of order with one released
    // already and the last lease taken; then the rest, the newest first, and leases taken
    // between and after.
    let batches = [
        vec![
            Entry::Releases(some(&(0..20).collect::<Vec<_>>())),
            Entry::Check,
        ],
        vec![
            Entry::Check,
            Entry::Releases(some(&[25, 19, 47, 20, 30])),
            Entry::Check,
            Entry::Releases(some(&[21, 22, 23])),
            Entry::Check,
        ],
        vec![
            Entry::Releases(some(&(24..47).rev().collect::<Vec<_>>())),
            Entry::Check,
            Entry::Check,
        ],
    ];
    for entries in batches {
        now_ms += 3;
        let answers = run(&mut client, keys, now_ms, &entries);
        let mut answered = answers.into_iter();
        for entry in &entries {
            match entry {
                Entry::Releases(ended) => {
                    for id in ended {
                        held.remove(id);
                    }
                }
                Entry::Check => {
                    let answer = answered.next().unwrap();
                    let taken = answer.0.expect("a slot was free");
                    assert!(!held.contains_key(&taken), "lease {taken} taken twice");
                    assert_eq!(
                        answer,
                        model_check(&mut held, now_ms, answer.0),
                        "{entries:?}"
                    );
                }
                Entry::Release(_) => unreachable!(),
            }
        }
        let count: u64 = redis::cmd("LLEN").arg(&leases).query(&mut client).unwrap();
        assert_eq!(count, held.len() as u64, "{entries:?}");
    }
}

/// One batch of `entries` (each its keys and its argument) of `shapes` at `now_ms`: each entry's
/// answer, `Ok` with its short form's items (admitted at once) or `Err` with the long form's.
fn batch(
    client: &mut redis::Connection,
    now_ms: u64,
    shapes: &[&str],
    entries: &[(Vec<&str>, String)],
) -> Vec<Result<Vec<i64>, Vec<i64>>> {
    let script = script();
    let mut invocation = script.prepare_invoke();
    invocation.arg(now_ms * 1_000).arg(shapes.len());
    for shape in shapes {
        invocation.arg(*shape);
    }
    for (keys, argument) in entries {
        for key in keys {
            invocation.key(*key);
        }
        invocation.arg(argument);
    }
    let packed: Vec<u8> = invocation.invoke(client).unwrap();
    let mut reader = &packed[..];
    let items = rmp::decode::read_array_len(&mut reader).unwrap();
    let numbers: Vec<i64> = (0..items)
        .map(|_| rmp::decode::read_int::<i64, _>(&mut reader).unwrap())
        .collect();
    // Every entry here is a token bucket of one rule: a short form of 3 items.
    let mut at = 1;
    let mut answers = Vec::new();
    for _ in entries {
        if numbers[at] >= 0 {
            answers.push(Ok(numbers[at..at + 3].to_vec()));
            at += 3;
        } else {
            let length = usize::try_from(-numbers[at]).unwrap();
            answers.push(Err(numbers[at + 1..at + 1 + length].to_vec()));
            at += 1 + length;
        }
    }
    assert_eq!(at, numbers.len(), "{numbers:?}");
    answers
}

#[test]
fn behind_a_claim_a_token_bucket_answers_the_wait_past_its_burst() {
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let prefix = unique_prefix("wire-claims");
    let (rule, claims) = (
        format!("{prefix}:{{upstream:llm}}:llm:tb:60000:1000:m"),
        format!("{prefix}:{{upstream:llm}}:llm:claims"),
    );
    let now_ms = hour_ahead();
    let shape = |units: u64| format!("tb|1|1:{units}:m||1000|60000|1000");
    let claimed = |id: u64| {
        (
            vec![rule.as_str(), claims.as_str()],
            format!("1#{id},600000"),
        )
    };
    let [full] = &batch(&mut client, now_ms, &[&shape(1_000)], &[claimed(1)])[..] else {
        panic!("one answer")
    };
    assert!(full.is_ok(), "{full:?}");
    let [waits] = &batch(&mut client, now_ms, &[&shape(900)], &[claimed(2)])[..] else {
        panic!("one answer")
    };
    assert!(waits.is_err(), "{waits:?}");
    // 57 s on, 950 are back: the call of 200 behind the claim of 900 waits until the 900 can have
    // gone and its own 200 dripped back, 9 s (allowed, delay, remaining, reset, retry).
    let [behind] = &batch(&mut client, now_ms + 57_000, &[&shape(200)], &[claimed(3)])[..] else {
        panic!("one answer")
    };
    let behind = behind.as_ref().unwrap_err();
    assert_eq!((behind[0], behind[4]), (0, 9_000), "{behind:?}");
}

#[test]
fn claims_on_a_shape_without_metered_units_answer_as_plain_checks() {
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let prefix = unique_prefix("wire-plain-claims");
    let (rule, claims) = (
        format!("{prefix}:{{upstream:api}}:api:tb:60000:1"),
        format!("{prefix}:{{upstream:api}}:api:claims"),
    );
    let now_ms = hour_ahead();
    let shape = "tb|1|1||1|60000|1";
    let entry = |id: u64, lasting: u64| {
        (
            vec![rule.as_str(), claims.as_str()],
            format!("1#{id},{lasting}"),
        )
    };
    // The one request, a refusal that claims, one behind it, and a withdrawal: answers all.
    let answers = batch(
        &mut client,
        now_ms,
        &[shape],
        &[
            entry(1, 600_000),
            entry(2, 600_000),
            entry(3, 600_000),
            entry(2, 0),
        ],
    );
    assert!(answers[0].is_ok(), "{answers:?}");
    for answer in &answers[1..] {
        let refused = answer.as_ref().unwrap_err();
        assert_eq!(refused[0], 0, "{answers:?}");
    }
}

/// A batch that turns out malformed part way (an entry naming no shape) answers an error, and
/// what its checks before did stands whole: their rules' charges and every quota charge, those
/// the batch counted itself (lua/entry.lua, quota_days) included.
#[test]
fn a_malformed_batch_keeps_every_charge_its_checks_made() {
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let prefix = unique_prefix("malformed");
    let (rule, quota) = (
        format!("{prefix}:{{ip:1}}:api:fw:5000:5"),
        format!("{prefix}:{{ip:1}}:daily:q:86400000:0"),
    );
    let now_ms = hour_ahead();
    let script = script();
    let mut invocation = script.prepare_invoke();
    invocation
        .arg(now_ms * 1_000)
        .arg(1)
        .arg("fw|2|1|0,0,0,10,86400000,0,0,0,0|5|5000");
    for _ in 0..3 {
        invocation.key(&rule).key(&quota).arg(1);
    }
    invocation.key(&rule).key(&quota).arg(9);
    let answer: Result<Vec<u8>, _> = invocation.invoke(&mut client);
    let error = answer.expect_err("an entry naming no shape");
    assert!(error.to_string().contains("malformed"), "{error}");
    let day = (now_ms - now_ms % 86_400_000).to_string();
    let counts: (u64, u64) = (
        redis::cmd("HGET")
            .arg(&rule)
            .arg((now_ms - now_ms % 5_000).to_string())
            .query(&mut client)
            .unwrap(),
        redis::cmd("HGET")
            .arg(&quota)
            .arg(&day)
            .query(&mut client)
            .unwrap(),
    );
    assert_eq!(counts, (3, 3), "the rule's and the quota's charges");
    let ttl: i64 = redis::cmd("PTTL").arg(&quota).query(&mut client).unwrap();
    assert!(ttl > 0, "{ttl}");
}

/// A batch's reply, item by item: a number, or an error's text.
fn reply_items(packed: &[u8]) -> Vec<Result<i64, String>> {
    let mut reader = packed;
    let items = rmp::decode::read_array_len(&mut reader).unwrap();
    (0..items)
        .map(|_| {
            if matches!(reader[0], 0xa0..=0xbf | 0xd9..=0xdb) {
                let length = rmp::decode::read_str_len(&mut reader).unwrap() as usize;
                let text = String::from_utf8(reader[..length].to_vec()).unwrap();
                reader = &reader[length..];
                Err(text)
            } else {
                Ok(rmp::decode::read_int::<i64, _>(&mut reader).unwrap())
            }
        })
        .collect()
}

#[test]
fn a_count_that_is_not_an_integer_fails_its_checks_and_not_the_batch() {
    // A bucket and a sliding counter holding "1.5", and a quota day a number past what a charge
    // can add to (written by something else):
    // the checks that would move them by a difference fail, each with its error, as the
    // command would have made them; the batch's writes left for its end never meet them, so the
    // batch answers, and a check of a sound key beside them counts.
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let seven = common::redis_server::has_functions(&mut client);
    let prefix = unique_prefix("not-integer");
    let now_ms = hour_ahead();
    let bucket = format!("{prefix}:{{ip:1}}:tb");
    let counter = format!("{prefix}:{{ip:1}}:sc");
    let (rule, quota) = (
        format!("{prefix}:{{ip:1}}:fw"),
        format!("{prefix}:{{ip:1}}:q"),
    );
    let sound = format!("{prefix}:{{ip:1}}:sound");
    let day = now_ms - now_ms % 86_400_000;
    let window = now_ms - now_ms % 3_600_000;
    redis::pipe()
        .cmd("SET")
        .arg(&bucket)
        .arg("1.5")
        .cmd("HSET")
        .arg(&counter)
        .arg("s")
        .arg(window)
        .arg("c")
        .arg("1.5")
        .arg("p")
        .arg(0)
        .cmd("HSET")
        .arg(&quota)
        .arg(day)
        .arg(i64::MAX)
        .exec(&mut client)
        .unwrap();
    let quota_shape = |kind: u8| format!("fw|2|1|0,0,0,10,86400000,0,0,0,{kind}|30|3600000");
    let script = script();
    let mut invocation = script.prepare_invoke();
    invocation
        .arg(now_ms * 1_000)
        .arg(5)
        .arg("tb|1|1||30|3600000|30")
        .arg("sc|1|1||30|3600000")
        .arg(quota_shape(1))
        .arg(quota_shape(0))
        .arg("fw|1|1||30|3600000");
    invocation.key(&bucket).arg(1);
    invocation.key(&counter).arg(2);
    invocation.key(&rule).key(&quota).arg(3);
    invocation.key(&rule).key(&quota).arg(4);
    invocation.key(&sound).arg(5);
    let packed: Vec<u8> = invocation.invoke(&mut client).expect("the batch answers");
    let items = reply_items(&packed);
    // Each entry: an error (-1 and its text), a full reply (its length negated), or a short form
    // of `short` items.
    let mut at = 1;
    let mut entry = |short: usize| -> Result<(), String> {
        match items[at].clone() {
            Ok(-1) => {
                at += 2;
                Err(items[at - 1].clone().unwrap_err())
            }
            Ok(first) if first < 0 => {
                at += 1 + usize::try_from(-first).unwrap();
                Ok(())
            }
            Ok(_) => {
                at += short;
                Ok(())
            }
            Err(text) => panic!("an error's text where an entry starts: {text}"),
        }
    };
    let not_integer = |answer: Result<(), String>| {
        let error = answer.expect_err("an error");
        assert!(error.contains("not an integer"), "{error}");
    };
    let bucket_answer = entry(3);
    if seven {
        not_integer(bucket_answer);
    } else {
        // Redis 6.2 writes a bucket whole (SET), whatever it held.
        bucket_answer.expect("an admission");
    }
    not_integer(entry(2));
    // The quota's peek reads the day; its check charges it at once, which Redis refuses.
    not_integer(entry(0));
    let error = entry(0).expect_err("the quota's charge fails");
    assert!(error.contains("overflow"), "{error}");
    entry(2).expect("the sound key's admission");
    assert_eq!(at, items.len(), "{items:?}");
    let count: u64 = redis::cmd("HGET")
        .arg(&sound)
        .arg(window)
        .query(&mut client)
        .unwrap();
    assert_eq!(count, 1);
    let counted: String = redis::cmd("HGET")
        .arg(&counter)
        .arg("c")
        .query(&mut client)
        .unwrap();
    assert_eq!(counted, "1.5", "the counter is left as it was");
}

/// One batch at `now_ms` of the release shape and `shapes` (numbered from 2), its `entries` each a
/// release (`1@…`, the leases' key) or a check (the counter's key, then the leases'): its packed
/// reply.
fn lease_batch(
    client: &mut redis::Connection,
    now_ms: u64,
    shapes: &[String],
    (counter, leases): (&str, &str),
    entries: &[&str],
) -> Vec<u8> {
    let script = script();
    let mut invocation = script.prepare_invoke();
    invocation
        .arg(now_ms * 1_000)
        .arg(shapes.len() + 1)
        .arg("rl|1");
    for shape in shapes {
        invocation.arg(shape);
    }
    for entry in entries {
        if entry.starts_with("1@") {
            invocation.key(leases);
        } else {
            invocation.key(counter).key(leases);
        }
        invocation.arg(*entry);
    }
    invocation.invoke(client).unwrap()
}

#[test]
fn releases_that_end_every_lease_let_a_shorter_lease_keep_its_own_length() {
    // 16 leases of a minute, then in one batch a 17th, the release of all 17 joined, and a lease
    // of 5 ms: the list held nothing more, so the short lease follows none and ends when it asks,
    // not with the minute-long ones before it.
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let prefix = unique_prefix("every-lease");
    let (counter, leases) = (
        format!("{prefix}:{{ip:1}}:fw"),
        format!("{prefix}:{{ip:1}}:leases"),
    );
    let shape = |lease_ms: u64| format!("fw|2|1|0,0,0,0,0,0,{MOST},{lease_ms},0|1000000|3600000");
    let now_ms = hour_ahead();
    let invoke = |entries: &[&str], client: &mut redis::Connection| {
        let shapes = [shape(LEASE_MS), shape(5)];
        lease_batch(client, now_ms, &shapes, (&counter, &leases), entries);
    };
    invoke(&["2"; 16], &mut client);
    let ids: Vec<String> = (0..17)
        .map(|taken| ((now_ms + LEASE_MS) * 1_000 + taken).to_string())
        .collect();
    let release = format!("1@{}", ids.join(" "));
    invoke(&["2", &release, "3"], &mut client);
    let held: Vec<String> = redis::cmd("LRANGE")
        .arg(&leases)
        .arg(0)
        .arg(-1)
        .query(&mut client)
        .unwrap();
    assert_eq!(held, [((now_ms + 5) * 1_000).to_string()]);
}

#[test]
fn joined_releases_of_ids_of_other_lengths_or_not_ids_end_what_they_name_and_fail_alone() {
    // The script guesses how many ids a joined release holds from the first's length, and proves
    // the guess before ending anything; ids of other lengths (one the list never held) take the
    // slower way and still end exactly the leases they name. A release whose ids are not numbers
    // answers an error, and the check after it in the batch answers as usual.
    let redis = TestRedis::shared();
    let mut client = redis.client();
    let prefix = unique_prefix("odd-releases");
    let (counter, leases) = (
        format!("{prefix}:{{ip:1}}:fw"),
        format!("{prefix}:{{ip:1}}:leases"),
    );
    let now_ms = hour_ahead();
    let shapes = [format!(
        "fw|2|1|0,0,0,0,0,0,{MOST},{LEASE_MS},0|1000000|3600000"
    )];
    let invoke = |entries: &[&str], client: &mut redis::Connection| {
        reply_items(&lease_batch(
            client,
            now_ms,
            &shapes,
            (&counter, &leases),
            entries,
        ))
    };
    invoke(&["2"; 4], &mut client);
    let ids: Vec<String> = (0..4)
        .map(|taken| ((now_ms + LEASE_MS) * 1_000 + taken).to_string())
        .collect();
    let held = |client: &mut redis::Connection| -> Vec<String> {
        redis::cmd("LRANGE")
            .arg(&leases)
            .arg(0)
            .arg(-1)
            .query(client)
            .unwrap()
    };
    assert_eq!(held(&mut client), ids);

    // A short id the list never held, then the second and the fourth lease.
    let odd = format!("1@7 {} {}", ids[1], ids[3]);
    let items = invoke(&[&odd], &mut client);
    assert_eq!(items[1..], [Ok(-2), Ok(1), Ok(0)], "{items:?}");
    assert_eq!(held(&mut client), [ids[0].clone(), ids[2].clone()]);

    // Not ids: that release fails, alone; the check after it takes a lease.
    for bad in ["1@12x4", &format!("1@{} 12x4", ids[0])] {
        let items = invoke(&[bad, "2"], &mut client);
        assert_eq!(items[1], Ok(-1), "{bad}: {items:?}");
        assert!(
            matches!(&items[2], Err(text) if text.contains("malformed lease id")),
            "{bad}: {items:?}"
        );
        // The check's short form: the rule's remaining and reset, the slots', the lease.
        assert_eq!(items.len(), 3 + 5, "{bad}: {items:?}");
        assert!(matches!(items[7], Ok(lease) if lease > 0), "{items:?}");
    }
    assert_eq!(
        held(&mut client).len(),
        4,
        "the two left and the two checks' leases"
    );
}
