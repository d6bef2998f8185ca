#include "common.hpp"

#include "build-info.h"
#include "chat.h"
#include "json-schema-to-grammar.h"

#include <string>

struct strata_chat_templates {
    common_chat_templates_ptr tmpls;
};

// ---- chat templates -------------------------------------------------------------------------

strata_chat_templates * strata_chat_templates_init(const struct llama_model * model, const char * tmpl_override, char ** err) {
    return guarded<strata_chat_templates *>(err, nullptr, [&]() -> strata_chat_templates * {
        auto t = common_chat_templates_init(model, tmpl_override ? tmpl_override : "");
        if (!t) {
            set_err(err, "failed to initialise chat templates");
            return nullptr;
        }
        return new strata_chat_templates{std::move(t)};
    });
}

void strata_chat_templates_free(strata_chat_templates * t) {
    delete t;
}

static common_chat_templates_inputs inputs_from_json(const json & j) {
    common_chat_templates_inputs in;
    in.messages = common_chat_msgs_parse_oaicompat(common_json::parse(j.at("messages").dump()));
    if (j.contains("tools") && !j.at("tools").is_null()) {
        in.tools = common_chat_tools_parse_oaicompat(common_json::parse(j.at("tools").dump()));
    }
    if (j.contains("tool_choice")) {
        in.tool_choice = common_chat_tool_choice_parse_oaicompat(j.at("tool_choice").get<std::string>());
    }
    in.add_generation_prompt = j.value("add_generation_prompt", true);
    if (j.contains("continue_final_message")) {
        in.continue_final_message = common_chat_continuation_parse(common_json::parse(j.at("continue_final_message").dump()));
    }
    in.use_jinja             = j.value("use_jinja", true);
    in.enable_thinking       = j.value("enable_thinking", true);
    in.parallel_tool_calls   = j.value("parallel_tool_calls", false);
    in.json_schema           = j.value("json_schema", std::string());
    in.grammar               = j.value("grammar", std::string());
    in.add_bos               = j.value("add_bos", false);
    in.force_pure_content    = j.value("force_pure_content", false);
    in.add_eos               = j.value("add_eos", false);
    in.reasoning_format      = common_reasoning_format_from_name(j.value("reasoning_format", std::string("none")));
    if (j.contains("chat_template_kwargs")) {
        for (const auto & [k, v] : j.at("chat_template_kwargs").items()) {
            in.chat_template_kwargs[k] = v.dump();
        }
    }
    return in;
}

static json trigger_json(const common_grammar_trigger & t) {
    return json{{"type", static_cast<int>(t.type)}, {"value", t.value}, {"token", t.token}};
}

char * strata_chat_templates_apply(const strata_chat_templates * t, const char * inputs_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() -> char * {
        const common_chat_params out = common_chat_templates_apply(t->tmpls.get(), inputs_from_json(json::parse(inputs_json)));
        json triggers = json::array();
        for (const auto & tr : out.grammar_triggers) {
            triggers.push_back(trigger_json(tr));
        }
        json delimiters = json::array();
        for (const auto & d : out.message_delimiters.delimiters) {
            delimiters.push_back({{"role", common_chat_role_to_string(d.role)}, {"delimiter", d.delimiter}});
        }
        json j = {
            {"prompt", out.prompt},
            {"format", static_cast<int>(out.format)},
            {"format_name", common_chat_format_name(out.format)},
            {"grammar", out.grammar},
            {"grammar_lazy", out.grammar_lazy},
            {"generation_prompt", out.generation_prompt},
            {"message_delimiters", delimiters},
            {"grammar_triggers", triggers},
            {"preserved_tokens", out.preserved_tokens},
            {"additional_stops", out.additional_stops},
            {"supports_thinking", out.supports_thinking},
            {"thinking_start_tag", out.thinking_start_tag},
            {"thinking_end_tags", out.thinking_end_tags},
            {"parser", out.parser},
        };
        return dup_string(j.dump());
    });
}

char * strata_chat_parse_inputs(const char * inputs_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        const json j = json::parse(inputs_json);
        const auto msgs  = common_chat_msgs_parse_oaicompat(common_json::parse(j.at("messages").dump()));
        const auto tools = common_chat_tools_parse_oaicompat(common_json::parse(j.at("tools").dump()));
        const auto choice = common_chat_tool_choice_parse_oaicompat(j.at("tool_choice").get<std::string>());
        json roles = json::array();
        for (const auto & m : msgs) {
            roles.push_back(m.role);
        }
        const json out = {
            {"roles", roles},
            {"last_has_tool_calls", !msgs.empty() && !msgs.back().tool_calls.empty()},
            {"n_tools", tools.size()},
            {"tool_choice_none", choice == COMMON_CHAT_TOOL_CHOICE_NONE},
        };
        return dup_string(out.dump());
    });
}

char * strata_chat_templates_source(const strata_chat_templates * t, const char * variant, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        return dup_string(common_chat_templates_source(t->tmpls.get(), variant ? variant : ""));
    });
}

char * strata_chat_templates_caps(const strata_chat_templates * t, char ** err) {
    return guarded<char *>(err, nullptr, [&]() {
        json caps = json::object();
        for (const auto & [k, v] : common_chat_templates_get_caps(t->tmpls.get())) {
            caps[k] = v;
        }
        return dup_string(caps.dump());
    });
}

bool strata_chat_templates_support_thinking(const strata_chat_templates * t) {
    try {
        return common_chat_templates_support_enable_thinking(t->tmpls.get());
    } catch (...) {
        return false;
    }
}

bool strata_chat_parser_check(const char * parser, char ** err) {
    return guarded<bool>(err, false, [&]() {
        common_chat_parser_params pp;
        pp.parser.load(parser);
        return true;
    });
}

char * strata_chat_parse(const char * text, bool is_partial, const char * parser_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() -> char * {
        const json j = json::parse(parser_json);
        common_chat_parser_params pp;
        pp.format               = static_cast<common_chat_format>(j.value("format", 0));
        pp.reasoning_format     = common_reasoning_format_from_name(j.value("reasoning_format", std::string("none")));
        pp.reasoning_in_content = j.value("reasoning_in_content", false);
        pp.generation_prompt    = j.value("generation_prompt", std::string());
        pp.parse_tool_calls     = j.value("parse_tool_calls", true);
        const std::string parser = j.value("parser", std::string());
        if (!parser.empty()) {
            pp.parser.load(parser);
        }
        const common_chat_msg msg = common_chat_parse(text, is_partial, pp);
        return dup_string(msg.to_json_oaicompat().dump());
    });
}

static common_chat_msg msg_from_json(const char * text) {
    const json j = json::parse(text);
    if (j.is_null() || j.empty()) {
        return common_chat_msg();
    }
    json m = j;
    if (!m.contains("role")) {
        m["role"] = "assistant";
    }
    auto msgs = common_chat_msgs_parse_oaicompat(common_json::parse(json::array({m}).dump()));
    return msgs.empty() ? common_chat_msg() : msgs.front();
}

char * strata_chat_msg_diffs(const char * prev_msg_json, const char * new_msg_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() -> char * {
        const auto diffs = common_chat_msg_diff::compute_diffs(msg_from_json(prev_msg_json), msg_from_json(new_msg_json));
        json out = json::array();
        for (const auto & d : diffs) {
            json delta = json::object();
            if (!d.reasoning_content_delta.empty()) {
                delta["reasoning_content"] = d.reasoning_content_delta;
            }
            if (!d.content_delta.empty()) {
                delta["content"] = d.content_delta;
            }
            if (d.tool_call_index != std::string::npos) {
                json tool_call;
                tool_call["index"] = d.tool_call_index;
                if (!d.tool_call_delta.id.empty()) {
                    tool_call["id"]   = d.tool_call_delta.id;
                    tool_call["type"] = "function";
                }
                if (!d.tool_call_delta.name.empty() || !d.tool_call_delta.arguments.empty()) {
                    json function = json::object();
                    if (!d.tool_call_delta.name.empty()) {
                        function["name"] = d.tool_call_delta.name;
                    }
                    if (!d.tool_call_delta.arguments.empty()) {
                        function["arguments"] = d.tool_call_delta.arguments;
                    }
                    tool_call["function"] = function;
                }
                delta["tool_calls"] = json::array({tool_call});
            }
            out.push_back(delta);
        }
        return dup_string(out.dump());
    });
}

bool strata_validate_filename(const char * filename) {
    try {
        return fs_validate_filename(filename);
    } catch (...) {
        return false;
    }
}

const char * strata_build_info(void) {
    return llama_build_info();
}

// ---- grammar --------------------------------------------------------------------------------

char * strata_json_schema_to_grammar(const char * schema_json, char ** err) {
    return guarded<char *>(err, nullptr, [&]() -> char * {
        return dup_string(json_schema_to_grammar(common_json::parse(schema_json)));
    });
}
