// The index behind prefix sharing: which published value (a snapshot) holds
// the K/V of the longest prefix of a token sequence.
//
// A radix tree (compressed trie) over token ids, as SGLang's RadixCache keeps
// one. A lookup walks edges token by token, so it costs O(matched tokens),
// never a scan over entries, and it matches at token granularity (inside an
// edge). Chained block hashes (vLLM, LMCache) match whole blocks only, and
// make a hash function part of what every client must reproduce exactly;
// token ids need no agreement beyond the tokenizer's.
//
// The caller keeps one tree per scope (namespace, model and layout: layouts
// never match each other). Every node knows two values:
//   ending    the value published for exactly the tokens up to the node's end;
//   covering  a value whose tokens run at least through the node's end (its own
//             ending or one below it): the answer for a match that stops in or
//             at the end of this node's edge.
// Values that can be restored only where they end (a rotating window, a
// recurrent state) are looked up `exact`: the longest published sequence that
// is itself a prefix of the tokens.
//
// Invariants (CheckInvariants): every node but the root has a covering and
// either an ending or two children or more (the tree stays compressed).
//
// Not thread-safe: the owner's lock guards it (lookups are const).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace kvcache::engine {

template <typename Value>
class PrefixTree {
 public:
  struct Match {
    std::optional<Value> value;  // none when nothing matched
    uint64_t matched_tokens = 0;
  };

  // Records `value` as the K/V of exactly `tokens` (not empty), and as the
  // covering of every node on their path (the newest publish answers).
  // Returns the value that was published for exactly these tokens before.
  std::optional<Value> Insert(absl::Span<const uint32_t> tokens, Value value) {
    if (tokens.empty()) return std::nullopt;  // the caller refuses empty prefixes
    std::vector<Node*> path;
    Node* node = root_.get();
    size_t at = 0;
    while (at < tokens.size()) {
      auto child = node->children.find(tokens[at]);
      if (child == node->children.end()) {
        node = AddLeaf(*node, tokens.subspan(at));
        at = tokens.size();
      } else {
        const size_t common = CommonLength(child->second->edge, tokens.subspan(at));
        node = common < child->second->edge.size() ? Split(*node, child->second, common)
                                                   : child->second.get();
        at += common;
      }
      path.push_back(node);
    }
    for (Node* on_path : path) on_path->covering = value;
    std::optional<Value> previous = std::exchange(node->ending, std::move(value));
    if (!previous.has_value()) ++values_;
    return previous;
  }

  // The longest prefix of `tokens` that some value covers (exact: that some
  // value ends at); no value and 0 tokens when none does.
  Match Lookup(absl::Span<const uint32_t> tokens, bool exact) const {
    Match best;
    const Node* node = root_.get();
    size_t at = 0;
    while (at < tokens.size()) {
      auto child = node->children.find(tokens[at]);
      if (child == node->children.end()) break;
      const Node& next = *child->second;
      const size_t common = CommonLength(next.edge, tokens.subspan(at));
      at += common;
      if (!exact) best = {next.covering, at};
      if (common < next.edge.size()) break;
      if (exact && next.ending.has_value()) best = {next.ending, at};
      node = &next;
    }
    return best;
  }

  // Forgets `value` as published for `tokens`: false (and no change) unless
  // it is what ends there. Nodes it alone covered go; the rest re-cover from
  // below and stay compressed.
  bool Erase(absl::Span<const uint32_t> tokens, const Value& value) {
    std::vector<Node*> path;
    Node* node = root_.get();
    size_t at = 0;
    while (at < tokens.size()) {
      auto child = node->children.find(tokens[at]);
      if (child == node->children.end()) return false;
      node = child->second.get();
      if (CommonLength(node->edge, tokens.subspan(at)) < node->edge.size()) return false;
      at += node->edge.size();
      path.push_back(node);
    }
    if (path.empty() || node->ending != value) return false;
    node->ending.reset();
    --values_;
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      if ((*it)->covering == value) (*it)->covering = CoveringFromBelow(**it);
    }
    for (auto it = path.rbegin(); it != path.rend(); ++it) Compress(**it);
    return true;
  }

  // Whether some value is published for a strict extension of `tokens`
  // (the node where they end has children: every node below is covered).
  bool Extended(absl::Span<const uint32_t> tokens) const {
    const Node* node = root_.get();
    size_t at = 0;
    while (at < tokens.size()) {
      auto child = node->children.find(tokens[at]);
      if (child == node->children.end()) return false;
      node = child->second.get();
      const size_t common = CommonLength(node->edge, tokens.subspan(at));
      at += common;
      // Ending inside an edge: the node below extends them.
      if (common < node->edge.size()) return at == tokens.size();
    }
    return !node->children.empty();
  }

  size_t values() const { return values_; }
  size_t nodes() const { return nodes_; }
  // Tokens stored on edges: the tree's memory is about 4 bytes each plus a
  // node's overhead per node.
  uint64_t stored_tokens() const { return stored_tokens_; }

  // Every (tokens, value) published, in no particular order.
  std::vector<std::pair<std::vector<uint32_t>, Value>> Entries() const {
    std::vector<std::pair<std::vector<uint32_t>, Value>> entries;
    std::vector<uint32_t> tokens;
    CollectEntries(*root_, tokens, entries);
    return entries;
  }

  // Empty when the invariants above hold; otherwise what breaks them.
  std::string CheckInvariants() const {
    uint64_t counted_nodes = 0, counted_tokens = 0, counted_values = 0;
    std::string broken = CheckBelow(*root_, counted_nodes, counted_tokens, counted_values);
    if (broken.empty() && (counted_nodes != nodes_ || counted_tokens != stored_tokens_ ||
                           counted_values != values_)) {
      broken = absl::StrCat("counts ", nodes_, "/", stored_tokens_, "/", values_, " but found ",
                            counted_nodes, "/", counted_tokens, "/", counted_values);
    }
    return broken;
  }

 private:
  struct Node {
    std::vector<uint32_t> edge;  // the tokens from the parent to this node
    absl::flat_hash_map<uint32_t, std::unique_ptr<Node>> children;  // by first token
    std::optional<Value> ending;
    std::optional<Value> covering;
    Node* parent = nullptr;
  };

  static size_t CommonLength(const std::vector<uint32_t>& edge, absl::Span<const uint32_t> tokens) {
    const size_t most = std::min(edge.size(), tokens.size());
    return std::mismatch(edge.begin(), edge.begin() + most, tokens.begin()).first - edge.begin();
  }

  Node* AddLeaf(Node& parent, absl::Span<const uint32_t> edge) {
    auto leaf = std::make_unique<Node>();
    leaf->edge.assign(edge.begin(), edge.end());
    leaf->parent = &parent;
    Node* added = leaf.get();
    parent.children.emplace(edge.front(), std::move(leaf));
    ++nodes_;
    stored_tokens_ += edge.size();
    return added;
  }

  // Puts a node ending `common` tokens into `child`'s edge between it and
  // `parent`; returns it.
  Node* Split(Node& parent, std::unique_ptr<Node>& child, size_t common) {
    auto middle = std::make_unique<Node>();
    middle->edge.assign(child->edge.begin(), child->edge.begin() + common);
    middle->covering = child->covering;
    middle->parent = &parent;
    child->edge.erase(child->edge.begin(), child->edge.begin() + common);
    child->parent = middle.get();
    const uint32_t rest_first = child->edge.front();
    middle->children.emplace(rest_first, std::move(child));
    child = std::move(middle);  // the parent's slot now holds the middle node
    ++nodes_;
    return child.get();
  }

  static std::optional<Value> CoveringFromBelow(const Node& node) {
    if (node.ending.has_value()) return node.ending;
    for (const auto& [first, child] : node.children) {
      if (child->covering.has_value()) return child->covering;
    }
    return std::nullopt;
  }

  // Removes `node` if it holds nothing, or merges it with its only child.
  void Compress(Node& node) {
    if (node.ending.has_value() || node.children.size() > 1) return;
    Node& parent = *node.parent;
    auto slot = parent.children.find(node.edge.front());
    if (node.children.empty()) {
      stored_tokens_ -= node.edge.size();
      --nodes_;
      parent.children.erase(slot);  // destroys `node`
      return;
    }
    std::unique_ptr<Node> only = std::move(node.children.begin()->second);
    only->edge.insert(only->edge.begin(), node.edge.begin(), node.edge.end());
    only->parent = &parent;
    --nodes_;                        // every token stays, on the merged edge
    slot->second = std::move(only);  // destroys `node`
  }

  void CollectEntries(const Node& node, std::vector<uint32_t>& tokens,
                      std::vector<std::pair<std::vector<uint32_t>, Value>>& entries) const {
    if (node.ending.has_value()) entries.emplace_back(tokens, *node.ending);
    for (const auto& [first, child] : node.children) {
      tokens.insert(tokens.end(), child->edge.begin(), child->edge.end());
      CollectEntries(*child, tokens, entries);
      tokens.resize(tokens.size() - child->edge.size());
    }
  }

  std::string CheckBelow(const Node& node, uint64_t& nodes, uint64_t& tokens,
                         uint64_t& values) const {
    values += node.ending.has_value();
    for (const auto& [first, child] : node.children) {
      ++nodes;
      tokens += child->edge.size();
      if (child->edge.empty() || child->edge.front() != first) return "a child under a wrong key";
      if (child->parent != &node) return "a child with a wrong parent";
      if (!child->covering.has_value()) return "a node without a covering";
      if (!child->ending.has_value() && child->children.size() < 2) return "an uncompressed node";
      std::string broken = CheckBelow(*child, nodes, tokens, values);
      if (!broken.empty()) return broken;
    }
    return "";
  }

  // On the heap, so that moving the tree leaves its children's parent pointers valid.
  std::unique_ptr<Node> root_ = std::make_unique<Node>();
  size_t nodes_ = 0;  // not counting the root
  uint64_t stored_tokens_ = 0;
  size_t values_ = 0;
};

}  // namespace kvcache::engine
